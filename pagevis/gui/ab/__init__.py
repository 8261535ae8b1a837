"""The A/B window: two sessions side by side, stepped together."""
