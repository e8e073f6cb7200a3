#!/usr/bin/env python3
"""Runs a Dockerfile's stages in chroots, then its final stage's command, for deploy/check-image.sh.

Understands the instructions krait's Dockerfiles use: ARG, FROM (debian:12 tags only: each stage
starts from a copy of --base), RUN (shell form, as `sh -c` in WORKDIR with ENV and ARG values),
WORKDIR, COPY (from the context filtered by the Dockerfile's .dockerignore, or --from a stage),
ENV, USER, EXPOSE, ENTRYPOINT, CMD (exec form) and LABEL. Anything else stops the check: it
must not pass a Dockerfile it did not run.
"""
import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def say(msg):
    print(f"== {time.strftime('%H:%M:%S')} {msg}", flush=True)


def parse(path):
    """The instructions as (keyword, rest) pairs: continuation lines joined, comments dropped."""
    out, cur = [], ""
    for raw in open(path, encoding="utf-8"):
        line = raw.rstrip("\n")
        if line.strip().startswith("#"):
            continue  # Docker drops comment lines, inside continuations too
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        cur += line
        if cur.strip():
            kw, _, rest = cur.strip().partition(" ")
            out.append((kw.upper(), rest.strip()))
        cur = ""
    return out


def subst(s, env):
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m.group(1) or m.group(2), ""), s)


def ignore_rules(dockerfile, context):
    """Docker's rules: the Dockerfile's own NAME.dockerignore, else the context's .dockerignore."""
    for p in (dockerfile + ".dockerignore", os.path.join(context, ".dockerignore")):
        if os.path.exists(p):
            rules = []
            for line in open(p, encoding="utf-8"):
                line = line.strip()
                if line and not line.startswith("#"):
                    neg = line.startswith("!")
                    pat = line.lstrip("!").strip().strip("/")
                    rules.append((neg, glob_rx(pat), pat))
            return p, rules
    return None, []


def glob_rx(pat):
    """Docker's pattern syntax (Go's filepath.Match plus **) as a regular expression."""
    out, i = "", 0
    while i < len(pat):
        if pat.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pat.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pat[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pat[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pat[i]), i + 1
    return re.compile(out)


def ignored(rel, rules):
    """A path is excluded when the last rule matching it, or one of its parents, excludes it."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    out = False
    for neg, rx, _ in rules:
        if any(rx.fullmatch(p) for p in prefixes):
            out = not neg
    return out


def copy_context(context, rules, dest):
    """The build context as docker would send it: every file the ignore rules leave."""
    n = 0
    for root, dirs, files in os.walk(context):
        relroot = os.path.relpath(root, context)
        relroot = "" if relroot == "." else relroot + "/"
        # not into excluded directories that no exception reaches into (.git, build trees)
        dirs[:] = [d for d in dirs if not ignored(relroot + d, rules)
                   or any(neg and pat.startswith(relroot + d + "/") for neg, _, pat in rules)]
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            rel = relroot + name
            if ignored(rel, rules):
                continue
            src, dst = os.path.join(root, name), os.path.join(dest, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copy2(src, dst, follow_symlinks=False)
            n += 1
    return n


class Mounts:
    def __init__(self):
        self.points = []

    def mount(self, *args):
        subprocess.run(["mount", *args], check=True)
        self.points.append(args[-1])

    def system(self, root):
        os.makedirs(os.path.join(root, "dev/pts"), exist_ok=True)
        self.mount("-t", "proc", "proc", os.path.join(root, "proc"))
        self.mount("-t", "sysfs", "sysfs", os.path.join(root, "sys"))
        self.mount("--bind", "/dev", os.path.join(root, "dev"))
        self.mount("--bind", "/dev/pts", os.path.join(root, "dev/pts"))

    def release(self):
        for p in reversed(self.points):
            if subprocess.run(["umount", p], stderr=subprocess.DEVNULL).returncode != 0:
                subprocess.run(["umount", "-l", p])
        self.points = []


def chroot_cmd(root, user, env, argv):
    spec = []
    if user and user not in ("root", "0", "0:0"):
        spec = ["--userspec=" + (user if ":" in user else f"{user}:{user}")]
    envs = [f"{k}={v}" for k, v in env.items()]
    return ["chroot", *spec, root, "/usr/bin/env", "-i", *envs, *argv]


def resolve_user(root, user):
    """USER by name becomes uid:gid from the stage's passwd (chroot --userspec wants ids to be safe)."""
    name, _, group = user.partition(":")
    if name.isdigit():
        return user
    for line in open(os.path.join(root, "etc/passwd")):
        f = line.split(":")
        if f[0] == name:
            return f"{f[2]}:{group or f[3]}"
    sys.exit(f"check-image: USER {name} is not in the stage's /etc/passwd")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--context", required=True)
    ap.add_argument("--port-wait", type=int, default=180)
    ap.add_argument("dockerfile")
    a = ap.parse_args()

    ins = parse(a.dockerfile)
    ign_file, rules = ignore_rules(a.dockerfile, a.context)
    say(f"{a.dockerfile}: {len(ins)} instructions; context {a.context}, ignore file {ign_file}")
    global_args, stages, st = {}, [], None
    mounts = Mounts()
    try:
        for kw, rest in ins:
            if kw == "ARG":
                k, _, v = rest.partition("=")
                (st["args"] if st else global_args)[k] = subst(v, {**global_args, **(st["args"] if st else {})})
                continue
            if kw == "FROM":
                mounts.release()
                m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.I)
                image = subst(m.group(1), global_args)
                if not re.fullmatch(r"debian:(12|bookworm)[\w.-]*", image):
                    sys.exit(f"check-image: FROM {image}: only Debian 12 bases can run here")
                st = {"name": m.group(2) or str(len(stages)), "root": os.path.join(a.work, f"stage{len(stages)}"),
                      "env": {"PATH": PATH, "HOME": "/root"}, "args": {}, "workdir": "/", "user": "",
                      "entrypoint": [], "cmd": [], "expose": []}
                stages.append(st)
                say(f"stage {st['name']}: FROM {image} (a copy of {a.base})")
                shutil.rmtree(st["root"], ignore_errors=True)
                subprocess.run(["cp", "-a", a.base, st["root"]], check=True)
                shutil.copy("/etc/resolv.conf", os.path.join(st["root"], "etc/resolv.conf"))
                mounts.system(st["root"])
                continue
            if st is None:
                sys.exit(f"check-image: {kw} before FROM")
            env = {**st["args"], **st["env"]}
            root = st["root"]
            if kw == "RUN":
                say(f"RUN {rest[:150]}{'...' if len(rest) > 150 else ''}")
                t0 = time.time()
                cmd = chroot_cmd(root, st["user"], env, ["/bin/sh", "-c", f"cd {shlex.quote(st['workdir'])} && {rest}"])
                r = subprocess.run(cmd)
                if r.returncode != 0:
                    sys.exit(f"check-image: RUN exited {r.returncode}")
                say(f"   done in {time.time() - t0:.0f}s")
            elif kw == "WORKDIR":
                st["workdir"] = os.path.join(st["workdir"], subst(rest, env))
                os.makedirs(root + st["workdir"], exist_ok=True)
            elif kw == "ENV":
                for tok in shlex.split(rest):
                    k, _, v = tok.partition("=")
                    st["env"][k] = subst(v, env)
            elif kw == "USER":
                st["user"] = resolve_user(root, subst(rest, env))
            elif kw == "COPY":
                toks = shlex.split(rest)
                src_root = None
                while toks[0].startswith("--"):
                    flag = toks.pop(0)
                    if flag.startswith("--from="):
                        name = flag[7:]
                        src_root = next((s["root"] for s in stages if s["name"] == name), None)
                        if not src_root:
                            sys.exit(f"check-image: COPY {flag}: no such stage")
                    else:
                        sys.exit(f"check-image: COPY {flag}: not supported here")
                *srcs, dst = [subst(t, env) for t in toks]
                dst = os.path.join(st["workdir"], dst)
                if src_root is None:  # the context, as docker would send it
                    src_root = os.path.join(a.work, "context")
                    if not os.path.isdir(src_root):
                        n = copy_context(a.context, rules, src_root)
                        say(f"   context: {n} files after {os.path.basename(ign_file or '(none)')}")
                for src in srcs:
                    s = os.path.join(src_root, src.lstrip("/"))
                    if os.path.isdir(s) and not os.path.islink(s):
                        os.makedirs(root + dst, exist_ok=True)
                        subprocess.run(["cp", "-a", s.rstrip("/") + "/.", root + dst], check=True)
                    else:
                        if not os.path.lexists(s):
                            sys.exit(f"check-image: COPY {src}: not found")
                        d = root + dst
                        if dst.endswith("/") or len(srcs) > 1:
                            os.makedirs(d, exist_ok=True)
                        subprocess.run(["cp", "-a", s, d], check=True)
                say(f"COPY {' '.join(srcs)[:120]} -> {dst}")
            elif kw == "EXPOSE":
                st["expose"] += [int(p.split("/")[0]) for p in rest.split()]
            elif kw in ("ENTRYPOINT", "CMD"):
                st[kw.lower()] = json.loads(rest)
            elif kw == "LABEL":
                pass
            else:
                sys.exit(f"check-image: {kw}: not supported here")
        mounts.release()
        return serve(stages[-1], a)
    finally:
        mounts.release()


def serve(st, a):
    """The final stage as Kubernetes runs it: its user, a read-only root, a tmpfs /tmp."""
    argv = st["entrypoint"] + st["cmd"]
    port = st["expose"][0] if st["expose"] else 8000
    if "--port" in argv:
        port = int(argv[argv.index("--port") + 1])
    say(f"image root: {subprocess.run(['du', '-sh', st['root']], capture_output=True, text=True).stdout.split()[0]}; "
        f"USER {st['user'] or 'root'}; running {' '.join(argv)}")
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
        sys.exit(f"check-image: port {port} is already taken on this machine")
    except OSError:
        pass
    ro = os.path.join(a.work, "run")
    os.makedirs(ro, exist_ok=True)
    mounts = Mounts()
    proc = None
    try:
        mounts.mount("--bind", st["root"], ro)
        subprocess.run(["mount", "-o", "remount,bind,ro", ro], check=True)
        mounts.mount("-t", "tmpfs", "-o", "mode=1777,size=64m", "tmpfs", os.path.join(ro, "tmp"))
        mounts.mount("-t", "proc", "proc", os.path.join(ro, "proc"))
        mounts.mount("--bind", "/dev", os.path.join(ro, "dev"))
        env = {**st["env"]}
        proc = subprocess.Popen(chroot_cmd(ro, st["user"], env, argv))
        t0 = time.time()
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None:
                sys.exit(f"check-image: the server exited {proc.returncode} before /health answered 200")
            if time.time() - t0 > a.port_wait:
                sys.exit("check-image: no /health 200 in time")
            time.sleep(1)
        say(f"/health 200 after {time.time() - t0:.1f}s")
        body = '{"messages":[{"role":"user","content":"Hello"}],"max_tokens":16}'
        r = subprocess.run(["curl", "-sS", "--max-time", "60", f"localhost:{port}/v1/chat/completions",
                            "-H", "Content-Type: application/json", "-d", body], capture_output=True, text=True)
        print("   response:", r.stdout[:400], flush=True)
        resp = json.loads(r.stdout)
        if resp.get("object") != "chat.completion" or not resp.get("choices"):
            sys.exit("check-image: no chat completion")
        say("SIGTERM to the server")
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        say(f"the server exited {rc}")
        if rc != 0:
            sys.exit("check-image: exit status after SIGTERM is not 0")
        proc = None
        say("PASS")
        return 0
    finally:
        if proc and proc.poll() is None:
            proc.kill()
            proc.wait()
        mounts.release()


if __name__ == "__main__":
    sys.exit(main())
