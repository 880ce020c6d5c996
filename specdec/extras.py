"""Optional dependencies, checked where a command starts: a command that needs a package of an extra it
lacks fails at once with one line naming the extra, before it loads a model or pulls one."""
from __future__ import annotations

import importlib

# import name -> the distribution pip installs (where they differ)
DISTRIBUTIONS = {"rouge_score": "rouge-score"}


class MissingExtraError(ValueError):
    """A ValueError, so the CLI prints it as its one `error:` line and exits 2."""


def require(module: str, extra: str, what: str) -> None:
    """Import `module` now, or raise MissingExtraError saying which extra brings it.

    Args:
        module: the import name (e.g. "rouge_score").
        extra: the specdec extra that installs it (e.g. "bench").
        what: the command that needs it, as the user typed it (e.g. "specdec eval").
    """
    try:
        importlib.import_module(module)
    except ImportError:
        dist = DISTRIBUTIONS.get(module, module)
        raise MissingExtraError(f"{what} needs {dist}: pip install 'specdec[{extra}]'") from None


def require_plotting(plot: str | None, what: str) -> None:
    """A PNG plot is asked for (a non-empty --plot): matplotlib must be there. An empty --plot skips it."""
    if plot:
        try:
            require("matplotlib", "bench", what)
        except MissingExtraError as e:
            raise MissingExtraError(f"{e} (or --plot '' for no plot)") from None
