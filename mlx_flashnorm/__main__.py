"""`mlx-flashnorm COMMAND ...` and `python -m mlx_flashnorm COMMAND ...`: one entry to every
command."""
import importlib
import sys

from . import __version__
from .errors import UserError, run_cli

COMMANDS = {  # command -> module with main(argv); imported only when run
    "generate": "mlx_flashnorm.generate",
    "chat": "mlx_flashnorm.chat",
    "server": "mlx_flashnorm.server",
    "bench": "mlx_flashnorm.bench.cli",
    "verify": "mlx_flashnorm.verify",
    "convert": "mlx_flashnorm.convert",
    "quantize": "mlx_flashnorm.quantize",
    "perplexity": "mlx_flashnorm.perplexity",
}
USAGE = f"usage: mlx-flashnorm [--version] {{{','.join(COMMANDS)}}} [--help] ..."


def dispatch(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\nEach command takes --help. Also: python -m mlx_flashnorm COMMAND ...")
        return
    if argv[0] == "--version":
        print(f"mlx-flashnorm {__version__}")
        return
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        raise UserError(f"unknown command '{command}'; choose one of {', '.join(COMMANDS)}")
    try:
        module = importlib.import_module(COMMANDS[command])
    except ModuleNotFoundError as e:
        if e.name != COMMANDS[command]:
            raise
        raise UserError(f"the {command} command is not part of mlx-flashnorm {__version__}; "
                        "upgrade mlx-flashnorm") from e
    sys.argv[0] = f"mlx-flashnorm {command}"
    return module.main(rest)


def main():
    return run_cli(lambda: dispatch(sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
