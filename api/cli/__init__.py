"""The `loraplex` command line (Typer + Rich). `app` is the console-script entry point."""

from api.cli.main import app

__all__ = ["app"]
