"""The main window: one decoding session, its controls, its worker and the views of its records."""
