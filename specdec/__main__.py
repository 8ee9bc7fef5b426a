"""python -m specdec"""
import sys

from specdec.cli import main

sys.exit(main())
