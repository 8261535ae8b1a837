"""Views and widgets every window shares: each view renders an immutable snapshot it is given."""
