"""The HTTP server, its engine client, auth and metrics, and the `loraplex` CLI (`api.cli`)."""
