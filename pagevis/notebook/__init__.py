"""pagevis in a notebook: the public Python API (`pagevis.Session`, `pagevis.compare`, `pagevis.load_trace`) and
the views its objects render inline (`_repr_html_`), made from the same view model and page as the HTML export.
`pagevis/__init__.py` exports the names lazily; see docs/notebook.md."""
