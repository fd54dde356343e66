"""Public op API: argument validation, normalisation, backend dispatch and fake (meta) registrations."""
