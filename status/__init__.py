"""driftline's live status page: scrapes every service's /metrics and charts the loop closing.

See :mod:`status.app` for the endpoints and :mod:`status.series` for the series and their metrics.
"""
