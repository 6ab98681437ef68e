# Install kreld on a host, or into a staging root for a package:
#
#   make install                          # /usr/local, dependencies from PyPI
#   make install PREFIX=/usr DESTDIR=/tmp/pkg NO_DEPS=1     # packagers
#
# PREFIX    where programs, units, sysusers.d and man pages go (default
#           /usr/local; systemd, systemd-sysusers and man search both
#           /usr and /usr/local).
# DESTDIR   staging root prepended to every path (default: none).
# PYTHON    the interpreter the installed kreld and kreldctl run with: their
#           #! line, and the one whose site directory under PREFIX receives
#           the package (default /usr/bin/python3).
# PIP       the pip that installs the wheel: the checkout's virtualenv's pip
#           run for $(PYTHON) ("--python"), so no pip is needed on the host's
#           Python; without a .venv, "$(PYTHON) -m pip".
# NO_DEPS=1 install kreld alone, offline: the distribution provides lmdb,
#           pyelftools, watchdog, structlog, pyudev and systemd-python.
#           Without it pip installs them beside kreld (from PyPI, or from
#           WHEELHOUSE=DIR of wheels with no network).
# SYSCONFDIR configuration root (default /etc, not under PREFIX: systemd's
#           ConfigurationDirectory= and kreld's default --config are there).
#
# The wheel is built from the checkout by scripts/build_wheel.py, with the
# standard library alone: no build backend, no network.

PREFIX ?= /usr/local
DESTDIR ?=
SYSCONFDIR ?= /etc
PYTHON ?= /usr/bin/python3
PIP ?= $(if $(wildcard .venv/bin/pip),.venv/bin/pip --python $(PYTHON),$(PYTHON) -m pip)
# The #! line of the installed programs: $(PYTHON) itself, absolute.
SHEBANG ?= $(shell $(PYTHON) -c 'import sys; print(sys.executable)')
NO_DEPS ?=
WHEELHOUSE ?=
BUILDDIR ?= build

BINDIR := $(PREFIX)/bin
UNITDIR := $(PREFIX)/lib/systemd/system
SYSUSERSDIR := $(PREFIX)/lib/sysusers.d
MANDIR := $(PREFIX)/share/man
# The site directory of $(PYTHON) under $(PREFIX): the one on its sys.path
# if there is one (Debian's python3 searches /usr/lib/python3/dist-packages
# and /usr/local/lib/python3.X/dist-packages), else its posix_prefix scheme.
PYTHONDIR ?= $(shell $(PYTHON) -c 'import sys, sysconfig; \
	p = [d for d in sys.path if d.startswith("$(PREFIX)/lib/") and d.endswith("-packages")]; \
	print(p[0] if p else sysconfig.get_path("purelib", "posix_prefix", {"base": "$(PREFIX)"}))')

VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
WHEEL := $(BUILDDIR)/kreld-$(VERSION)-py3-none-any.whl
STAGE := $(BUILDDIR)/stage
PIP_FLAGS := --disable-pip-version-check --no-compile --no-warn-script-location
PIP_FLAGS += $(if $(NO_DEPS),--no-deps --no-index)
PIP_FLAGS += $(if $(WHEELHOUSE),--no-index --find-links=$(WHEELHOUSE))
MANPAGES := man/kreldctl.1 man/kreld.toml.5 man/kreld.8

.PHONY: all wheel install install-python install-data check-python uninstall clean
.DELETE_ON_ERROR:

all: wheel

wheel: $(WHEEL)

$(WHEEL): pyproject.toml README.md $(shell find kreld -name "*.py" -o -name "*.varlink") scripts/build_wheel.py
	$(PYTHON) scripts/build_wheel.py --outdir $(BUILDDIR) .

install: install-python install-data

# pip installs into a staging directory, which is then copied to the site
# directory: pip's own --prefix scheme differs between Python builds (Debian's
# maps /usr to /usr/local), and the units must find kreld in $(BINDIR).
install-python: $(WHEEL) check-python
	rm -rf $(STAGE)
	$(PIP) install $(PIP_FLAGS) --target=$(STAGE) $(WHEEL)
	rm -f $(STAGE)/kreld-$(VERSION).dist-info/direct_url.json
	install -d $(DESTDIR)$(PYTHONDIR) $(DESTDIR)$(BINDIR)
	for f in $(STAGE)/*; do \
		case $${f##*/} in bin) ;; *) rm -rf $(DESTDIR)$(PYTHONDIR)/$${f##*/}; \
		cp -R $$f $(DESTDIR)$(PYTHONDIR)/ ;; esac; \
	done
	for f in kreld kreldctl; do \
		sed '1s|^#!.*|#!$(SHEBANG)|' $(STAGE)/bin/$$f > $(DESTDIR)$(BINDIR)/$$f && \
		chmod 755 $(DESTDIR)$(BINDIR)/$$f; \
	done
	$(PYTHON) -m compileall -q -d $(PYTHONDIR)/kreld $(DESTDIR)$(PYTHONDIR)/kreld >/dev/null

install-data: $(MANPAGES) systemd/kreld.service systemd/kreld.socket systemd/kreld.sysusers
	install -d $(DESTDIR)$(UNITDIR) $(DESTDIR)$(SYSUSERSDIR) $(DESTDIR)$(SYSCONFDIR)/kreld \
		$(DESTDIR)$(MANDIR)/man1 $(DESTDIR)$(MANDIR)/man5 $(DESTDIR)$(MANDIR)/man8
	sed 's|^ExecStart=/usr/bin/kreld|ExecStart=$(BINDIR)/kreld|' systemd/kreld.service \
		> $(DESTDIR)$(UNITDIR)/kreld.service
	chmod 644 $(DESTDIR)$(UNITDIR)/kreld.service
	install -m 644 systemd/kreld.socket $(DESTDIR)$(UNITDIR)/kreld.socket
	install -m 644 systemd/kreld.sysusers $(DESTDIR)$(SYSUSERSDIR)/kreld.conf
	install -m 644 man/kreldctl.1 $(DESTDIR)$(MANDIR)/man1/kreldctl.1
	install -m 644 man/kreld.toml.5 $(DESTDIR)$(MANDIR)/man5/kreld.toml.5
	install -m 644 man/kreld.8 $(DESTDIR)$(MANDIR)/man8/kreld.8
	# An existing configuration is the administrator's: never overwritten.
	test -e $(DESTDIR)$(SYSCONFDIR)/kreld/kreld.toml || \
		install -m 644 etc/kreld/kreld.toml $(DESTDIR)$(SYSCONFDIR)/kreld/kreld.toml

check-python:
	@test -n "$(PYTHONDIR)" || { echo "no site directory for $(PYTHON) under $(PREFIX)" >&2; exit 1; }

# Leaves the configuration and the store (/var/lib/kreld) in place.
uninstall: check-python
	rm -f $(DESTDIR)$(BINDIR)/kreld $(DESTDIR)$(BINDIR)/kreldctl \
		$(DESTDIR)$(UNITDIR)/kreld.service $(DESTDIR)$(UNITDIR)/kreld.socket \
		$(DESTDIR)$(SYSUSERSDIR)/kreld.conf $(DESTDIR)$(MANDIR)/man1/kreldctl.1 \
		$(DESTDIR)$(MANDIR)/man5/kreld.toml.5 $(DESTDIR)$(MANDIR)/man8/kreld.8
	rm -rf $(DESTDIR)$(PYTHONDIR)/kreld $(DESTDIR)$(PYTHONDIR)/kreld-$(VERSION).dist-info

clean:
	rm -rf $(BUILDDIR)
