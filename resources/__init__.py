"""Data files shipped with pagevis (icons, sample prompts, sample texts), read via importlib.resources."""
