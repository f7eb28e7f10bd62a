"""OpenAI-compatible HTTP server with admission control (``minserve serve``).

app.py routes and the life of a request, async_engine.py the engine thread, admission.py the
overload policy, deadlines.py its deadline model, auth.py API keys and tenants, limits.py what a
request may weigh before any work, protocol.py the request bodies and errors, serving.py the
conversions.
"""

from typing import TYPE_CHECKING

from minserve import lazy

# Imported on first use (minserve/lazy.py): `minserve serve --help` and its argument errors answer
# without loading PyTorch, which create_app's engine needs.
__getattr__, __dir__ = lazy.exports(globals(), {
    **dict.fromkeys(("AdmissionConfig", "AdmissionController", "ClassLimits"), "minserve.server.admission"),
    "create_app": "minserve.server.app",
    **dict.fromkeys(("Auth", "Principal"), "minserve.server.auth"),
    "RequestLimits": "minserve.server.limits",
})

if TYPE_CHECKING:
    from minserve.server.admission import AdmissionConfig, AdmissionController, ClassLimits
    from minserve.server.app import create_app
    from minserve.server.auth import Auth, Principal
    from minserve.server.limits import RequestLimits

__all__ = ["AdmissionConfig", "AdmissionController", "Auth", "ClassLimits", "Principal",
           "RequestLimits", "create_app"]
