import sys

from feedline.cli import main

sys.exit(main(["producer", *sys.argv[1:]]))
