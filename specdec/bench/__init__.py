"""Benchmarks: the `specdec bench` modes and `specdec profile-drafts`, on the public engine API.
May import quality (scoring, plots) and server (the AsyncEngine behind `bench serve`); never the CLI."""
