from ..errors import run_cli
from . import main

run_cli(main)
