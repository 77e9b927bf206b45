"""What `das` reports to a user as one line (`workers.cli.main`), besides the parts' own errors: `InvalidInput`
for settings, files and data a user gave that do not hold. A plain ValueError anywhere is a bug and keeps its
traceback."""

from __future__ import annotations


class InvalidInput(ValueError):
    """A setting, a file or data a user gave DAS does not hold (an engine option, a problem file, a trace, an
    engine report)."""
