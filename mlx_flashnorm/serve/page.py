"""The chat page at GET /: static files shipped in the package (serve/page/), served as they are,
without the API key (the page asks for it when the API answers 401). The page calls the API from
the server's own origin; its Content-Security-Policy lets it load and call nothing else."""
import ipaddress
from importlib import resources
from urllib.parse import urlsplit

# URL path -> (file in page/, Content-Type)
FILES = {"/": ("index.html", "text/html; charset=utf-8"),
         "/index.html": ("index.html", "text/html; charset=utf-8"),
         "/app.js": ("app.js", "text/javascript; charset=utf-8"),
         "/style.css": ("style.css", "text/css; charset=utf-8")}
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
           "Referrer-Policy": "no-referrer",
           "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
                                      "frame-ancestors 'none'; base-uri 'none'; form-action 'none'"}


def asset(path):
    """(body, Content-Type) of the page's file at the URL path (its query ignored), or None."""
    found = FILES.get(path.split("?", 1)[0])
    if found is None:
        return None
    name, kind = found
    return resources.files(__package__).joinpath("page", name).read_bytes(), kind


def same_origin(origin, host):
    """Whether a request's Origin is the server's own (the chat page's calls): the Host the
    browser sent, as an IP address or localhost. Not a DNS name: another site's name can be made to
    resolve to this machine (DNS rebinding), and its pages would then be of the same origin as
    the server; a page opened under a name needs --cors-origin."""
    if not host or origin.lower() != f"http://{host}".lower():
        return False
    try:
        name = urlsplit(origin).hostname
    except ValueError:
        return False
    if name == "localhost":
        return True
    try:
        ipaddress.ip_address(name or "")
    except ValueError:
        return False
    return True
