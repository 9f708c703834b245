import sys

from feedline.cli import main

sys.exit(main(["broker", *sys.argv[1:]]))
