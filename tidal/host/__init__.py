"""Hosting a job: the composition of the coordinator with what serves and shows it.

``runner`` runs a job (a supervised coordinator, its API server, the control loop, the
dashboard's history and TensorBoard); ``server`` is the HTTP API with the dashboard's pages
and the Prometheus exposition. It sits above ``tidal.coordinator`` and ``tidal.dashboard``,
which never import it: the coordinator knows nothing of what serves or shows it.
"""
