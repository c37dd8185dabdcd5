"""Dashboard pages (server-rendered) and their static files; Plotly.js comes from the `plotly` package."""

from ampwatch.web.pages import router

__all__ = ["router"]
