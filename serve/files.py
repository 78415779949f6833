"""Static file decisions: request path -> file in one site snapshot, plus the pure HTTP rules.

Read top to bottom, a request goes through:

1. `parse_request_path`: raw request-target bytes -> clean path segments, or `Refused`.
2. `open_snapshot`: the site root opened once, so one request sees one build (see below).
3. `lookup`: segments -> an open file (`Found`) or a canonical-slash `Redirect`, or `Refused(404)`.
4. `accepts_gzip`, `make_etag`, `is_not_modified`, `content_type`: pure functions the app combines.

**Snapshots.** build.py publishes by atomically replacing the `public` symlink. `open_snapshot`
opens the root directory once per request, following that one symlink; every later open is
relative to that directory fd (`openat`). A request that started on the old build keeps reading
the old build even after the swap, and even after the old folder is deleted (open fds keep their
inodes alive). A request can never see a mix of two builds.

**Containment.** Below the root no symlink is ever followed: every component is opened with
`O_NOFOLLOW` relative to its parent's fd. The kernel therefore enforces that every byte served
comes from a real file under the snapshot, with no check-then-open race (Starlette's realpath +
commonpath check has one).

**Sidecars.** build.py writes `x.gz` beside each compressible `x`. A `.gz` file whose base name
also exists is a sidecar: it is reachable only through content negotiation on `x`, and a direct
request for it is 404. A `.gz` file with no base file is an ordinary resource (application/gzip).
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections import OrderedDict
from dataclasses import dataclass
from email.utils import formatdate, parsedate_to_datetime
from pathlib import Path
from urllib.parse import quote, unquote_to_bytes, urlsplit

SIDECAR_SUFFIX = ".gz"


@dataclass(frozen=True)
class FileSettings:
    """What the static file layer serves and how much it will hold in memory."""

    # The published site. A symlink here is followed once per request (the snapshot); that is
    # the only symlink ever followed.
    root: Path
    # Served for a folder URL ending in "/". One fixed name: no directory listings, ever.
    index_name: str = "index.html"
    # Sent with status 404 from the same snapshot; absent -> a plain-text 404.
    not_found_name: str = "404.html"
    # Longest raw request path accepted (414 beyond). Site URLs are short; long ones are probes.
    max_path_bytes: int = 2048
    # Deepest path accepted. Bounds the openat() calls one request can cost.
    max_segments: int = 32
    # Files up to this size are kept in memory after the first read. Bigger files stream from
    # their fd, so one huge file cannot evict the whole site.
    cache_max_file_bytes: int = 256 * 1024
    # Memory ceiling per worker for cached bodies; least recently used entries go first.
    cache_max_total_bytes: int = 64 * 1024 * 1024
    # Prepared responses (header blocks; bodies of small files) remembered per worker. Old
    # builds' entries are never hit again and age out.
    cache_max_entries: int = 4096
    # Read size when streaming a large file: big enough for few syscalls, small enough that a
    # slow client holds little memory.
    chunk_bytes: int = 64 * 1024


class Refused(Exception):
    """The request will not be served; `status` is the whole answer and `reason` is for logs."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"{status}: {reason}")
        self.status = status
        self.reason = reason


# --- 1. the request path ---------------------------------------------------------------------


@dataclass(frozen=True)
class RequestPath:
    segments: tuple[str, ...]  # decoded, each a plain file name (no "/", no "." or ".." names)
    trailing_slash: bool  # the URL names a folder

    @property
    def url(self) -> str:
        """The canonical path, decoded: one slash between segments, "/" after a folder."""
        path = "/" + "/".join(self.segments)
        return path + "/" if self.trailing_slash and self.segments else path

    @property
    def href(self) -> str:
        """The canonical path percent-encoded, safe to put in a Location header."""
        return quote(self.url, safe="/")


NAME_MAX = 255  # bytes per file name on Linux file systems (ext4, xfs, tmpfs)
_REFUSED_CHARACTER = re.compile(r"[\x00-\x1f\x7f\\]")


def parse_request_path(raw_path: bytes, settings: FileSettings) -> RequestPath:
    """Turn the raw request-target path (bytes, query already removed) into clean segments.

    Each refusal names the attack it blocks. Malformed input gets 400; names that are
    well-formed but never served (dotfiles, over-long names) get 404, so probing learns nothing.
    """
    if len(raw_path) > settings.max_path_bytes:
        # Resource exhaustion and buffer-overflow probes against whatever sits behind us.
        raise Refused(414, "request path too long")
    if not raw_path.startswith(b"/"):
        # Absolute-form ("http://other/x") or asterisk-form targets: we are no proxy.
        raise Refused(400, "request target is not an absolute path")
    try:
        # Decode exactly once: "%252e%252e" stays the literal name "%2e%2e", never "..".
        text = unquote_to_bytes(raw_path).decode("utf-8", errors="strict")
    except UnicodeDecodeError:
        # Overlong UTF-8 ("%c0%ae" for ".", "%c0%af" for "/"): the classic decoder-mismatch
        # traversal. A strict decoder rejects every non-shortest form.
        raise Refused(400, "request path is not valid UTF-8") from None
    bad = _REFUSED_CHARACTER.search(text)
    if bad is not None:
        if bad.group() == "\\":
            # Backslash is a separator on Windows; "..\\" must not mean anything anywhere.
            raise Refused(400, "backslash in request path")
        # NUL truncates paths in C APIs ("a.html%00.png"); CR/LF would split a Location header.
        raise Refused(400, "control character in request path")
    return _split_segments(text, settings)


def _split_segments(text: str, settings: FileSettings) -> RequestPath:
    # Empty segments ("//x", "/a//b") are dropped, so no segment can make a join absolute.
    segments = tuple(s for s in text.split("/") if s)
    if len(segments) > settings.max_segments:
        raise Refused(404, "request path too deep")
    for segment in segments:
        if segment in (".", ".."):
            # Dot-segments: conforming clients remove them (RFC 3986 5.2.4) before sending,
            # so one that arrives is a traversal attempt ("/../secret", "/a/%2e%2e/../x").
            raise Refused(400, "dot-segment in request path")
        if segment.startswith("."):
            # Dotfiles (.git, .env, .htpasswd) are never part of a published site.
            raise Refused(404, "hidden name")
        if len(segment.encode("utf-8")) > NAME_MAX:
            # The kernel would answer ENAMETOOLONG; refuse before spending a syscall.
            raise Refused(404, "name too long")
    return RequestPath(segments, trailing_slash=text.endswith("/"))


# --- 2. the snapshot ---------------------------------------------------------------------------

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
# O_NOFOLLOW: a symlink below the root fails with ELOOP instead of leading outside it.
# O_NONBLOCK: opening a FIFO planted in the tree returns at once instead of hanging the worker.
_BENEATH_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def open_snapshot(root: Path) -> int:
    """Open the site root directory; the fd pins one build for the whole request."""
    try:
        return os.open(root, _DIR_FLAGS)
    except OSError as error:
        raise Refused(_status_for_os_error(error), f"site root unavailable: {error}") from None


def _status_for_os_error(error: OSError) -> int:
    """The one place a file-system error becomes a status."""
    if error.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
        # Out of descriptors or memory: a transient overload, not a missing file.
        return 503
    # ENOENT, ENOTDIR, ELOOP (a symlink we refuse), EACCES, ENAMETOOLONG: all "not here".
    return 404


# --- 3. lookup -------------------------------------------------------------------------------


@dataclass
class Found:
    """An open regular file under the snapshot, ready to send. The caller closes `fd`."""

    fd: int
    stat: os.stat_result
    url: str  # canonical URL of the resource (of the base file when a sidecar is sent)
    name: str  # file name of the resource; its extension decides the MIME type
    encoding: str | None  # "gzip" when the sidecar was chosen
    has_variants: bool  # a gzip sidecar exists, so the response varies on Accept-Encoding


@dataclass(frozen=True)
class Redirect:
    location: str  # path-absolute; never built from the Host header


def lookup(
    root_fd: int, path: RequestPath, gzip_ok: bool, settings: FileSettings
) -> Found | Redirect:
    """Resolve `path` beneath the snapshot, choose the encoding, and open the file.

    `root_fd` stays the caller's to close; every folder opened below it is closed here.
    """
    dir_fd = root_fd
    try:
        for segment in path.segments[:-1]:
            child = _descend(dir_fd, segment)
            _close_below(dir_fd, root_fd)
            dir_fd = child
        if not path.segments:
            return _open_variant(dir_fd, settings.index_name, path.url, gzip_ok)
        name = path.segments[-1]
        opened = _open_beneath(dir_fd, name)
        if opened is None:
            raise Refused(404, f"no file {name!r}")
        fd, st = opened
        if stat.S_ISDIR(st.st_mode):
            _close_below(dir_fd, root_fd)
            dir_fd = fd
            if not path.trailing_slash:
                # Canonical folder URLs end in "/", so relative links inside them resolve.
                return Redirect(RequestPath(path.segments, trailing_slash=True).href)
            # A folder is served only through its index: listings would publish every name.
            return _open_variant(dir_fd, settings.index_name, path.url, gzip_ok)
        return _choose_variant(dir_fd, fd, st, name, path, gzip_ok)
    finally:
        _close_below(dir_fd, root_fd)


def _close_below(dir_fd: int, root_fd: int) -> None:
    if dir_fd != root_fd:
        os.close(dir_fd)


def lookup_not_found_page(root_fd: int, gzip_ok: bool, settings: FileSettings) -> Found | None:
    """The 404 page from the same snapshot as the request, or None when the site has none."""
    try:
        found = lookup(root_fd, RequestPath((settings.not_found_name,), False), gzip_ok, settings)
    except Refused:
        return None
    return found if isinstance(found, Found) else None


def _descend(parent_fd: int, name: str) -> int:
    """Open a sub-folder relative to its parent; no symlink is followed."""
    try:
        return os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent_fd)
    except OSError as error:
        raise Refused(_status_for_os_error(error), f"no folder {name!r}: {error}") from None


def _open_beneath(dir_fd: int, name: str) -> tuple[int, os.stat_result] | None:
    """Open a folder or regular file in `dir_fd`; None when absent or anything else.

    The fstat of the opened fd, not an earlier stat, is the truth about what we send.
    """
    try:
        fd = os.open(name, _BENEATH_FLAGS, dir_fd=dir_fd)
    except OSError as error:
        if _status_for_os_error(error) == 503:
            raise Refused(503, f"cannot open {name!r}: {error}") from None
        return None
    st = os.fstat(fd)
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        # FIFOs, sockets and devices are never served, even if planted in the tree.
        os.close(fd)
        return None
    return fd, st


def _exists(dir_fd: int, name: str) -> bool:
    """Whether `name` exists at all in `dir_fd` (a dangling symlink counts); never follows."""
    # faccessat(F_OK) answers the same question as an lstat without building a stat_result.
    return os.access(name, os.F_OK, dir_fd=dir_fd, follow_symlinks=False)


def _choose_variant(
    dir_fd: int, fd: int, st: os.stat_result, name: str, path: RequestPath, gzip_ok: bool
) -> Found:
    """Given the opened file `name`, maybe swap it for its gzip sidecar."""
    if path.trailing_slash:
        os.close(fd)
        # "page.html/" names a folder that does not exist.
        raise Refused(404, "file requested as a folder")
    if name.endswith(SIDECAR_SUFFIX) and _exists(dir_fd, name[: -len(SIDECAR_SUFFIX)]):
        os.close(fd)
        # A sidecar is a representation of its base file, never a resource of its own.
        raise Refused(404, "gzip sidecar requested by name")
    return _with_sidecar(dir_fd, fd, st, name, path.url, gzip_ok)


def _open_variant(dir_fd: int, name: str, url: str, gzip_ok: bool) -> Found:
    """Open the regular file `name` in `dir_fd` (an index or the 404 page) with its sidecar."""
    opened = _open_beneath(dir_fd, name)
    if opened is None or not stat.S_ISREG(opened[1].st_mode):
        if opened is not None:
            os.close(opened[0])
        raise Refused(404, f"no file {name!r}")
    return _with_sidecar(dir_fd, opened[0], opened[1], name, url, gzip_ok)


def _with_sidecar(
    dir_fd: int, fd: int, st: os.stat_result, name: str, url: str, gzip_ok: bool
) -> Found:
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise Refused(404, "not a regular file")
    if name.endswith(SIDECAR_SUFFIX):
        return Found(fd, st, url, name, None, has_variants=False)
    sidecar = name + SIDECAR_SUFFIX
    if not gzip_ok:
        # The identity response still varies on Accept-Encoding when a sidecar exists.
        return Found(fd, st, url, name, None, has_variants=_exists(dir_fd, sidecar))
    opened = _open_beneath(dir_fd, sidecar)
    if opened is None or not stat.S_ISREG(opened[1].st_mode):
        if opened is not None:
            os.close(opened[0])
        return Found(fd, st, url, name, None, has_variants=False)
    os.close(fd)
    return Found(opened[0], opened[1], url, name, "gzip", has_variants=True)


# --- 4. pure HTTP rules --------------------------------------------------------------------------


def accepts_gzip(accept_encoding: str | None) -> bool:
    """Whether Accept-Encoding allows gzip (RFC 9110 12.5.3).

    An explicit "gzip" (or its alias "x-gzip") entry wins over "*"; q=0 means "not acceptable".
    No header, or a q-value we cannot parse, means identity: the safe answer for any client.
    """
    if not accept_encoding:
        return False
    star_q: float | None = None
    for item in accept_encoding.split(","):
        coding, _, params = item.partition(";")
        coding = coding.strip().lower()
        q = _quality(params)
        if coding in ("gzip", "x-gzip"):
            return q > 0
        if coding == "*":
            star_q = q
    return star_q is not None and star_q > 0


def is_cross_site(sec_fetch_site: str | None, referer: str | None, host: str | None) -> bool:
    """Whether another site's page made this request.

    BREACH needs an attacker's page to make the victim's browser fetch our pages many times and
    watch the compressed lengths, so responses to cross-site requests go uncompressed. Fetch
    metadata (Sec-Fetch-Site) decides when the browser sends it; otherwise a Referer from another
    host does. No Referer at all (typed URL, curl, our own no-referrer pages) is not cross-site.
    """
    if sec_fetch_site is not None:
        return sec_fetch_site.strip().lower() == "cross-site"
    if referer is None:
        return False
    try:
        referer_host = urlsplit(referer.strip()).netloc.lower()
    except ValueError:
        return True  # unparsable: assume the worst, and merely skip compression
    return referer_host != (host or "").strip().lower()


def _quality(params: str) -> float:
    """The q parameter of one list member; absent means 1, malformed means 0."""
    for param in params.split(";"):
        key, _, value = param.partition("=")
        if key.strip().lower() == "q":
            try:
                q = float(value.strip())
            except ValueError:
                return 0.0
            # "nan", "inf" and out-of-range values parse as floats but are not qvalues.
            return q if 0.0 <= q <= 1.0 else 0.0
    return 1.0


def make_etag(st: os.stat_result, encoding: str | None) -> str:
    """A strong validator from size and mtime; each encoding is its own representation."""
    tag = f"{st.st_mtime_ns:x}-{st.st_size:x}"
    return f'"{tag}-gz"' if encoding == "gzip" else f'"{tag}"'


def http_date(timestamp: float) -> str:
    return formatdate(timestamp, usegmt=True)


def is_not_modified(
    if_none_match: str | None, if_modified_since: str | None, etag: str, mtime: float
) -> bool:
    """RFC 9110 13.1: does a conditional GET/HEAD get 304?

    If-None-Match, when present, decides alone (13.2.2), compared weakly (13.1.2) because a
    cache may hold "W/" forms. If-Modified-Since is only consulted without it; an unparsable
    date is ignored, as the RFC requires.
    """
    if if_none_match is not None:
        if if_none_match.strip() == "*":
            return True
        wanted = _strip_weak(etag)
        return any(_strip_weak(tag.strip()) == wanted for tag in if_none_match.split(","))
    if if_modified_since is not None:
        try:
            since = parsedate_to_datetime(if_modified_since).timestamp()
        except (TypeError, ValueError, IndexError, OverflowError):
            return False
        # HTTP dates have whole seconds; compare the file's time at that resolution.
        return int(mtime) <= since
    return False


def _strip_weak(tag: str) -> str:
    return tag[2:] if tag.startswith("W/") else tag


# An explicit map: /etc/mime.types differs between machines, and a wrong type plus nosniff
# breaks a page. Unknown extensions are octet-stream, which browsers will not render.
MIME_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".htm": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".json": "application/json",
    ".map": "application/json",
    ".webmanifest": "application/manifest+json",
    ".xml": "application/xml",
    ".txt": "text/plain; charset=utf-8",
    ".md": "text/markdown; charset=utf-8",
    ".csv": "text/csv; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".gif": "image/gif",
    ".webp": "image/webp",
    ".avif": "image/avif",
    ".ico": "image/x-icon",
    ".woff": "font/woff",
    ".woff2": "font/woff2",
    ".ttf": "font/ttf",
    ".otf": "font/otf",
    ".wasm": "application/wasm",
    ".pdf": "application/pdf",
    ".gz": "application/gzip",
    ".mp4": "video/mp4",
    ".webm": "video/webm",
}
DEFAULT_MIME_TYPE = "application/octet-stream"


def content_type(name: str) -> str:
    _, dot, extension = name.rpartition(".")
    if not dot:
        return DEFAULT_MIME_TYPE
    return MIME_TYPES.get("." + extension.lower(), DEFAULT_MIME_TYPE)


# --- 5. the response cache --------------------------------------------------------------------


def file_identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What makes an opened file this exact content: (device, inode, size, mtime_ns, ctime_ns).

    Taken from fstat of the fd a request opened in its own snapshot, so a cache keyed on it can
    never hand the old build's bytes to a request on the new build: the new build's files are
    other inodes. ctime cannot be set from user space, so even an in-place rewrite that restores
    size and mtime changes the identity.
    """
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class LRUCache:
    """A least-recently-used map bounded by entry count and by the summed cost of its values."""

    def __init__(self, max_entries: int, max_cost: int) -> None:
        self.max_entries = max_entries
        self.max_cost = max_cost
        self._entries: OrderedDict[object, tuple[object, int]] = OrderedDict()
        self._cost = 0

    def get(self, key: object) -> object | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: object, value: object, cost: int) -> None:
        if key in self._entries or cost > self.max_cost:
            return
        self._entries[key] = (value, cost)
        self._cost += cost
        while self._cost > self.max_cost or len(self._entries) > self.max_entries:
            _, (_, evicted_cost) = self._entries.popitem(last=False)
            self._cost -= evicted_cost

    def __len__(self) -> int:
        return len(self._entries)


def read_whole(fd: int, size: int) -> bytes:
    """Read a small file from its fd; loops because read() may return less than asked."""
    parts = []
    remaining = size
    while remaining > 0:
        chunk = os.read(fd, remaining)
        if not chunk:
            break
        parts.append(chunk)
        remaining -= len(chunk)
    return b"".join(parts)


def last_modified(st: os.stat_result) -> str:
    return http_date(st.st_mtime)
