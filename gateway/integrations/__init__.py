"""The queue integrations: Celery (``gateway.integrations.celery``), RQ (``.rq``), arq (``.arq``) and
Dramatiq (``.dramatiq``) report their jobs' lives to the gateway through the Python clients
(``gateway.client``), never the server's code.
"""
