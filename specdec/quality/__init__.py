"""Quality assurance: A/B evaluation against a reference configuration (`specdec eval`), the
statistical losslessness check (`specdec check-lossless`) and the optional similarity monitor.
Imports nothing from bench, server or the CLI (they may import it)."""
