"""The server process: its settings, its wiring (app), its command line."""
