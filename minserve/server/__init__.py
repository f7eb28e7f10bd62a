"""OpenAI-compatible HTTP server with admission control (``minserve serve``).

app.py routes and the life of a request, async_engine.py the engine thread, admission.py the
overload policy, protocol.py the request bodies and errors, serving.py the conversions.
"""

from minserve.server.admission import AdmissionConfig, AdmissionController, ClassLimits
from minserve.server.app import create_app

__all__ = ["AdmissionConfig", "AdmissionController", "ClassLimits", "create_app"]
