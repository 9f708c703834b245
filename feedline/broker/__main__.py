import sys

from feedline.broker.cli import add_parser
from feedline.flags import standalone

sys.exit(standalone(add_parser, "broker", sys.argv[1:]))
