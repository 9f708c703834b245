import sys

from feedline.flags import standalone
from feedline.producer.cli import add_parser

sys.exit(standalone(add_parser, "producer", sys.argv[1:]))
