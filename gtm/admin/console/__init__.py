"""The console: server-rendered pages for compliance teams and operators, served by the admin
listener under ``/console``.

The console holds no privilege of its own. A person signs in with what the admin API accepts
(an API token, or an OIDC access token); the token travels in an encrypted, HttpOnly session
cookie, and every page and action is a call to the admin API in the same process with that
token (:mod:`gtm.admin.console.api`). So the API's role checks, four-eyes rule, safety rules and
event log apply to the browser exactly as to ``curl``: hiding a button is a courtesy, the refusal
is the API's.
"""

from gtm.admin.console.app import invalid_page, is_console, mount

__all__ = ["invalid_page", "is_console", "mount"]
