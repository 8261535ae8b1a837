"""Sessions as files anyone can open without pagevis: video (MP4, WebM, GIF) with captions, and HTML pages."""
