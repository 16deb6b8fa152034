import os
import sys

# Worker modules in this folder must be importable by the fork server's children.
sys.path.insert(0, os.path.dirname(__file__))
