"""How `sparsevllm` commands end: exit statuses, and the error every command raises for
input it cannot run (reported as one line, without a traceback)."""

from __future__ import annotations

EXIT_OK = 0
EXIT_USAGE = 2  # bad flags or input: argparse's own status for usage errors
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as a shell reports it
EXIT_PIPE_CLOSED = 141  # the reader of stdout went away (128 + SIGPIPE), e.g. `| head`

EXIT_STATUS_HELP = (
    f"exit status: {EXIT_OK} done; {EXIT_USAGE} usage or input error (one line on stderr); "
    f"{EXIT_INTERRUPTED} interrupted (Ctrl-C); {EXIT_PIPE_CLOSED} output pipe closed "
    "(e.g. `| head`); 1 an unexpected failure (with a traceback)."
)


class UsageError(Exception):
    """Input that can never run: reported as `error: <message>`, exit status 2."""
