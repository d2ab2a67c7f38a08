"""The OpenAI-compatible HTTP the proxy and the simulated server both speak.

``openai_io``   request parsing and validation, OpenAI-style error bodies
``asgi``        raw ASGI helpers for the proxy's hot path (headers, bounded body, responses)
``disconnect``  noticing a client that went away while a handler works
``serving``     running an ASGI app on a real socket inside the current event loop

May import ``regional_lb.balancing`` (cost shapes, admission's Retry-After) and nothing of
``upstream``, ``sim`` or ``proxy``.
"""
