import sys
from pathlib import Path

# tests/launch.py and tests/dist/*.py import each other by module name
sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent / "dist"), str(Path(__file__).parent.parent)]
