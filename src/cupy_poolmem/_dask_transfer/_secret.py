"""The per-host secret that lets separately started workers of one user share pool IPC.

``auto`` (a 0600 file in the user's runtime or 0700 temporary directory, made on
first use) or a path to a 0600 file of the user; the sharing key is derived from
it.  Anything less private is refused with :class:`InvalidOptionError`
(docs/dask.rst, "per-host secret").
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import secrets
import stat
import tempfile

from .._errors import InvalidOptionError, OptionTypeError

__all__ = ["AUTO", "authkey_from_secret", "default_dir", "load_secret"]

#: The config value that asks for the secret in the user's runtime directory.
AUTO = "auto"
#: The file's name in that directory.
FILE_NAME = "dask-secret"
#: The fewest bytes a secret file may hold.
MIN_BYTES = 16
_KEY_SALT = b"cupy_poolmem sharing authkey 1"
_KEY = "distributed.comm.cupy-poolmem.secret"


def _fix_mode(path: str) -> str:
    return f"chmod 600 {path}"


def _check_private_dir(path: str) -> None:
    """``path`` is a directory (no symlink) of this user, mode 0700 or stricter."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise InvalidOptionError(f"{_KEY}: cannot use directory {path!r} ({exc})") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise InvalidOptionError(
            f"{_KEY}: {path!r} is not a directory (a symbolic link or a file); remove it "
            "or set DASK_DISTRIBUTED__COMM__CUPY_POOLMEM__SECRET to a file of yours"
        )
    if st.st_uid != os.getuid():
        raise InvalidOptionError(
            f"{_KEY}: directory {path!r} belongs to uid {st.st_uid}, not to this user "
            f"(uid {os.getuid()}); another user may read the secret there. Remove it, or "
            "name a file of yours"
        )
    if st.st_mode & 0o077:
        raise InvalidOptionError(
            f"{_KEY}: directory {path!r} has mode {stat.S_IMODE(st.st_mode):04o}; other "
            f"users may reach the secret there. Run: chmod 700 {path}"
        )


def default_dir(environ: dict[str, str] | None = None) -> str:
    """Where ``secret: auto`` keeps the secret: ``$XDG_RUNTIME_DIR/cupy_poolmem`` when
    that is the user's own 0700 directory, else ``<tmp>/cupy_poolmem-<uid>``.

    Examples
    --------
    >>> default_dir({}).endswith(f"cupy_poolmem-{os.getuid()}")
    True
    """
    env = os.environ if environ is None else environ
    xdg = env.get("XDG_RUNTIME_DIR")
    if xdg:
        try:
            _check_private_dir(xdg)
            return os.path.join(xdg, "cupy_poolmem")
        except InvalidOptionError:
            pass
    return os.path.join(tempfile.gettempdir(), f"cupy_poolmem-{os.getuid()}")


def _ensure_dir(path: str) -> None:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise InvalidOptionError(f"{_KEY}: cannot create directory {path!r} ({exc})") from None
    _check_private_dir(path)


def _create(path: str) -> None:
    """Create the secret at ``path`` unless it exists (atomic: a file fully written is
    linked into place, so a worker starting meanwhile reads all of it or none)."""
    d = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=".secret-", dir=d)  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_hex(32).encode())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another worker made it first: use theirs
    finally:
        os.unlink(tmp)


def _read(path: str) -> bytes:
    """The secret in ``path``, refused unless it is a 0600 regular file of this user."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        why = "a symbolic link (name the file itself)" if exc.errno == errno.ELOOP else exc.strerror
        raise InvalidOptionError(
            f"{_KEY}={path!r}: cannot read the secret file: {why}. Make one with: "
            f"head -c 32 /dev/urandom | base64 > {path}; chmod 600 {path}"
        ) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise InvalidOptionError(f"{_KEY}={path!r} is not a regular file")
        if st.st_uid != os.getuid():
            raise InvalidOptionError(
                f"{_KEY}={path!r} belongs to uid {st.st_uid}, not to this user (uid "
                f"{os.getuid()}); use a secret file of your own"
            )
        if st.st_mode & 0o077:
            raise InvalidOptionError(
                f"{_KEY}={path!r} has mode {stat.S_IMODE(st.st_mode):04o}: other users can "
                f"read it, so they could connect to this worker's memory. Run: {_fix_mode(path)}"
            )
        data = f.read(1 << 16).strip()
    if len(data) < MIN_BYTES:
        raise InvalidOptionError(
            f"{_KEY}={path!r} holds {len(data)} bytes; give at least {MIN_BYTES} random "
            f"bytes: head -c 32 /dev/urandom | base64 > {path}"
        )
    return data


def load_secret(spec: str | None, base_dir: str | None = None) -> bytes | None:
    """The secret ``spec`` names: ``None`` (none), ``"auto"`` or a file path.

    ``base_dir``: the directory ``"auto"`` uses (default :func:`default_dir`).

    Raises
    ------
    InvalidOptionError
        The file or its directory is not private to this user, or too short.

    Examples
    --------
    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> len(load_secret("auto", base_dir=d)) >= 16
    True
    >>> load_secret(None) is None
    True
    """
    if spec is None or spec is False or spec == "":
        return None
    if not isinstance(spec, str):
        raise OptionTypeError(
            f"{_KEY}={spec!r} must be 'auto', a file path, or null; got {type(spec).__name__}"
        )
    if spec.strip().lower() == AUTO:
        d = base_dir if base_dir is not None else default_dir()
        _ensure_dir(d)
        path = os.path.join(d, FILE_NAME)
        if not os.path.lexists(path):
            _create(path)
        return _read(path)
    return _read(os.path.expanduser(spec))


def authkey_from_secret(secret: bytes) -> bytes:
    """The sharing sockets' key derived from ``secret`` (the secret itself never travels).

    Examples
    --------
    >>> authkey_from_secret(b"x" * 16) == authkey_from_secret(b"x" * 16)
    True
    >>> len(authkey_from_secret(b"x" * 16))
    32
    """
    return hmac.new(secret, _KEY_SALT, hashlib.sha256).digest()
