"""The admin API's routers, one module per resource; each route names its operation
(:data:`gtm.admin.permissions.OPERATIONS`) through :func:`gtm.admin.auth.require`."""
