class UserError(Exception):
    """Bad input from the user: the CLI prints the message on one line and exits with code 2."""


def run_cli(main):
    """Run main(args) turning UserError (and Ctrl-C) into a one-line message and exit code 2;
    --verbose shows the traceback."""
    import sys

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
