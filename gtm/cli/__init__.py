"""The ``gtm`` command (typer): one module per group of sub-commands.

``main``    the app: ``serve``, ``explain``, ``policy``, ``db``, ``audit`` (and the groups below)
``fleet``   ``gtm region ...`` and ``gtm config ...``: operator controls and published documents
``common``  option types, settings, error reporting and the asyncio runner every command shares

The outermost layer: may import anything in ``gtm``; nothing in ``gtm`` imports it but the
demo. A new sub-command goes into the module of its group, or a new module beside them.
"""
