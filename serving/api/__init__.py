"""serving's HTTP endpoints, one router per concern, each endpoint at module level taking the
replica as a dependency (``Depends(serving.replica.serving_of)``); :func:`serving.app.create_app`
includes them and adds the API-key dependency where a route asks for a key.

* :mod:`serving.api.rank` - ``POST /rank``
* :mod:`serving.api.actions` - ``POST /actions``
* :mod:`serving.api.probes` - ``/healthz``, ``/readyz``, ``/ping`` and ``/metrics``
"""
