from ..errors import run_cli
from .decode import main

run_cli(main)
