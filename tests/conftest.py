import os
import sys

# tests import helpers such as tests/attention_reference.py as top-level modules
sys.path.insert(0, os.path.dirname(__file__))
