"""GET /docs: Swagger UI over /openapi.json, served offline. Its script, stylesheet and icon come from
the installed `swagger-ui-bundle` package under /docs/assets (FastAPI's default page loads them
from a CDN, which an air-gapped host cannot reach). Installed only when the schema is published."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.staticfiles import StaticFiles

ASSETS = "/docs/assets"


def install(app: FastAPI) -> None:
    """Add /docs and its assets to `app` (whose schema is at app.openapi_url)."""
    from swagger_ui_bundle import swagger_ui_path  # imported here: only a server that publishes docs needs it

    app.mount(ASSETS, StaticFiles(directory=swagger_ui_path), name="swagger_ui_assets")

    @app.get("/docs", include_in_schema=False)
    async def docs():
        return get_swagger_ui_html(openapi_url=app.openapi_url or "/openapi.json", title=f"{app.title} API",
                                   swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{ASSETS}/favicon-32x32.png")
