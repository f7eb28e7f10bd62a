"""OpenAI-compatible HTTP server with admission control (``minserve serve``).

app.py routes and the life of a request, async_engine.py the engine thread, admission.py the
overload policy, deadlines.py its deadline model, auth.py API keys and tenants, limits.py what a
request may weigh before any work, protocol.py the request bodies and errors, serving.py the
conversions.
"""

from minserve.server.admission import AdmissionConfig, AdmissionController, ClassLimits
from minserve.server.app import create_app
from minserve.server.auth import Auth, Principal
from minserve.server.limits import RequestLimits

__all__ = ["AdmissionConfig", "AdmissionController", "Auth", "ClassLimits", "Principal",
           "RequestLimits", "create_app"]
