import argparse
import os
import sys


class UserError(Exception):
    """Bad input from the user: the CLI prints the message on one line and exits with code 2."""


def run_cli(main):
    """Run main(args) turning UserError (and Ctrl-C) into a one-line message and exit code 2;
    --verbose shows the traceback."""
    verbose = "--verbose" in sys.argv
    try:
        return main()
    except UserError as e:
        if verbose:
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:  # the reader of our output left (`... | head -1`): stop quietly
        # nothing left to flush at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help shows each option's default (flags and options without a default show none)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return text
        return text if "%(default)" in text else f"{text} (default: %(default)s)".strip()
