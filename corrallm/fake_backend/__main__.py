import sys

from corrallm.fake_backend import main

main(sys.argv[1:])
