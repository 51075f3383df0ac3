"""The admin UI's routers, one per page (or group of forms)."""
