"""``python -m status``: the live status page."""

from status.app import main

if __name__ == "__main__":
    raise SystemExit(main())
