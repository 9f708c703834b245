import sys

from feedline.commands.main import main

sys.exit(main())
