from ..errors import run_cli
from .cli import main

run_cli(main)
