"""The balancer's HTTP surface: ``regional-lb serve``.

``app``    the OpenAI-compatible endpoints (raw ASGI) and the app that assembles the balancer
``admin``  operational endpoints (FastAPI): models, capacity report, health, metrics, drain
           and membership

The top layer of the balancer: may import every other package of ``regional_lb``; only the CLI
imports it. A new endpoint goes here.
"""
