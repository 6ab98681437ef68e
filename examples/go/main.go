// Command kreld-profiler does with kreld what a profiler does, through the Go
// bindings that varlink/go's generator makes from kreld/io.kreld.varlink:
//
//  1. GetBoot: the boot it samples on (build-id, runtime _text, KASLR offset);
//  2. Resolve: one batch of addresses, at a time of the samples (-at, -clock),
//     the compact reply spelled out per address;
//  3. Subscribe (more: true): the modules and kernel code live now, then each load, update
//     and unload as kreld records it (a module's in "module", a BPF program's
//     or other kernel code's in "code"), until -events of them or -timeout.
//
// It prints one JSON object a line: {"boot": ...}, then {"resolved": [...]}
// (each address as `kreldctl resolve --json` prints it), then every reply of
// Subscribe as it comes.  Exit status as kreldctl's: 0 ok, 1 error, 2 usage,
// 3 no such boot, 4 permission denied or addresses restricted.
//
//	go generate && go build && ./kreld-profiler -events 1 0xffffffffc03bb010
package main

//go:generate cp ../../kreld/io.kreld.varlink iokreld/io.kreld.varlink
//go:generate go run github.com/varlink/go/cmd/varlink-go-interface-generator iokreld/io.kreld.varlink

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/varlink/go/varlink"

	"kreld.example/profiler/iokreld"
)

type options struct {
	socket  string
	boot    *string
	at      *int64
	clock   *string
	events  int
	timeout time.Duration
	addrs   []uint64
}

// usageError is a bad command line: exit status 2.
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

func parseOptions(args []string) (options, error) {
	var o options
	fs := flag.NewFlagSet("kreld-profiler", flag.ContinueOnError)
	fs.StringVar(&o.socket, "socket", "/run/kreld/kreld.sock", "kreld's socket")
	boot := fs.String("boot", "", "a boot-id or a unique prefix (default: the current boot)")
	at := fs.String("at", "", "resolve at this time, in ns on -clock (default: now)")
	clock := fs.String("clock", "", `the clock of -at: "monotonic" (kreld's default), "boottime" or "realtime"`)
	fs.IntVar(&o.events, "events", 0, "stop after this many events past the first reply (0: no limit)")
	fs.DurationVar(&o.timeout, "timeout", 0, "stop following events after this long (0: never)")
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: kreld-profiler [options] ADDRESS...")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return o, err
		}
		return o, usageError{err.Error()}
	}
	if *boot != "" {
		o.boot = boot
	}
	if *clock != "" {
		o.clock = clock
	}
	if *at != "" {
		t, err := strconv.ParseInt(*at, 10, 64)
		if err != nil {
			return o, usageError{fmt.Sprintf("-at %q: not a time in nanoseconds", *at)}
		}
		o.at = &t
	}
	if o.events < 0 || o.timeout < 0 {
		return o, usageError{"-events and -timeout cannot be negative"}
	}
	for _, a := range fs.Args() {
		v, err := strconv.ParseUint(strings.TrimPrefix(strings.ToLower(a), "0x"), 16, 64)
		if err != nil {
			return o, usageError{fmt.Sprintf("%q: not a hex address", a)}
		}
		o.addrs = append(o.addrs, v)
	}
	return o, nil
}

// Resolved is one address of a Resolve reply, spelled out.
type Resolved struct {
	Address      string  `json:"address"`
	Image        string  `json:"image,omitempty"`
	Section      string  `json:"section,omitempty"`
	Base         string  `json:"base,omitempty"`
	Seq          *int64  `json:"seq,omitempty"`
	BuildID      *string `json:"build_id,omitempty"`
	Offset       string  `json:"offset,omitempty"`
	Symbol       string  `json:"symbol,omitempty"`
	SymbolOffset string  `json:"symbol_offset,omitempty"`
}

// spellOut turns Resolve's compact reply into one Resolved per address: the
// symbols are listed region by region (regions[k].names of them in region k);
// symbol[i] indexes them, or is -2 minus a region's index where no symbol is
// known, or -1 where no region held the address.
func spellOut(addrs []uint64, regions []iokreld.ResolveRegion, symbols []string, symbol, offset []int64) ([]Resolved, error) {
	if len(symbol) != len(addrs) || len(offset) != len(addrs) {
		return nil, fmt.Errorf("Resolve answered %d entries for %d addresses", len(symbol), len(addrs))
	}
	owner := make([]int, 0, len(symbols)) // the region each symbol lies in
	for k, r := range regions {
		if r.Names < 0 || r.Names > int64(len(symbols)-len(owner)) {
			return nil, fmt.Errorf("Resolve's regions name more than its %d symbols", len(symbols))
		}
		for n := int64(0); n < r.Names; n++ {
			owner = append(owner, k)
		}
	}
	if len(owner) != len(symbols) {
		return nil, fmt.Errorf("Resolve's regions name %d of its %d symbols", len(owner), len(symbols))
	}
	out := make([]Resolved, len(addrs))
	for i, a := range addrs {
		out[i].Address = fmt.Sprintf("%#x", a)
		si, ri := symbol[i], int64(-1)
		switch {
		case si >= int64(len(symbols)):
			return nil, fmt.Errorf("Resolve: symbol index %d out of range", si)
		case si >= 0:
			ri = int64(owner[si])
			out[i].Symbol = symbols[si]
			out[i].SymbolOffset = fmt.Sprintf("%#x", offset[i])
		case si <= -2:
			ri = -2 - si
		}
		if ri >= int64(len(regions)) {
			return nil, fmt.Errorf("Resolve: region index %d out of range", ri)
		}
		if ri >= 0 {
			r := regions[ri]
			base, err := strconv.ParseUint(strings.TrimPrefix(r.Base, "0x"), 16, 64)
			if err != nil {
				return nil, fmt.Errorf("Resolve: region base %q: %v", r.Base, err)
			}
			out[i].Image, out[i].Section, out[i].Base = r.Image, r.Section, r.Base
			out[i].Seq, out[i].BuildID = r.Seq, r.Build_id
			out[i].Offset = fmt.Sprintf("%#x", a-base)
		}
	}
	return out, nil
}

// event is one Subscribe reply, printed as it came.
type event struct {
	Event   string                 `json:"event"`
	Modules *[]iokreld.Incarnation `json:"modules,omitempty"`
	Module  *iokreld.Incarnation   `json:"module,omitempty"`
	Code    *iokreld.KernelCode    `json:"code,omitempty"`
	// The snapshot's: the kernel code live when it was taken.
	KernelCode *[]iokreld.KernelCode `json:"kernel_code,omitempty"`
}

func emit(v interface{}) error {
	return json.NewEncoder(os.Stdout).Encode(v)
}

func resolve(ctx context.Context, c *varlink.Connection, o options) error {
	hex := make([]string, len(o.addrs))
	for i, a := range o.addrs {
		hex[i] = fmt.Sprintf("%#x", a)
	}
	// Without lines (nil): the reply's lines is null.
	regions, symbols, symbol, offset, _, err := iokreld.Resolve().Call(ctx, c, hex, o.boot, o.at, o.clock, nil)
	if err != nil {
		return err
	}
	res, err := spellOut(o.addrs, regions, symbols, symbol, offset)
	if err != nil {
		return err
	}
	return emit(map[string][]Resolved{"resolved": res})
}

// follow prints Subscribe's replies until o.events events past the first, or
// until o.timeout passes (an error only when -events was not reached).
func follow(ctx context.Context, c *varlink.Connection, o options) error {
	if o.timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, o.timeout)
		defer cancel()
	}
	receive, err := iokreld.Subscribe().Send(ctx, c, varlink.More)
	if err != nil {
		return err
	}
	for seen := -1; o.events == 0 || seen < o.events; seen++ {
		name, modules, module, code, live, flags, err := receive(ctx)
		// The library sets ctx's deadline on the socket too: either may fire first.
		if errors.Is(err, os.ErrDeadlineExceeded) || errors.Is(err, context.DeadlineExceeded) ||
			errors.Is(ctx.Err(), context.DeadlineExceeded) {
			if o.events == 0 {
				return nil
			}
			if seen < 0 {
				return fmt.Errorf("no reply to Subscribe in %v", o.timeout)
			}
			return fmt.Errorf("%d of %d events in %v", seen, o.events, o.timeout)
		}
		if err != nil {
			return err
		}
		if err := emit(event{name, modules, module, code, live}); err != nil {
			return err
		}
		if flags&varlink.Continues == 0 {
			return errors.New("kreld ended the subscription")
		}
	}
	return nil
}

func run(o options) error {
	ctx := context.Background()
	c, err := varlink.NewConnection(ctx, "unix:"+o.socket)
	if err != nil {
		return err
	}
	defer c.Close()
	boot, err := iokreld.GetBoot().Call(ctx, c, o.boot)
	if err != nil {
		return err
	}
	if err := emit(map[string]iokreld.Boot{"boot": boot}); err != nil {
		return err
	}
	if len(o.addrs) > 0 {
		if err := resolve(ctx, c, o); err != nil {
			return err
		}
	}
	return follow(ctx, c, o)
}

// exitCode maps the generated error types to kreldctl's exit statuses.
func exitCode(err error) int {
	var usage usageError
	var noBoot *iokreld.NoSuchBoot
	var ambiguous *iokreld.AmbiguousBoot
	var denied *iokreld.PermissionDenied
	var restricted *iokreld.AddressesRestricted
	switch {
	case errors.As(err, &usage):
		return 2
	case errors.As(err, &noBoot), errors.As(err, &ambiguous):
		return 3
	case errors.As(err, &denied), errors.As(err, &restricted):
		return 4
	}
	return 1
}

func main() {
	o, err := parseOptions(os.Args[1:])
	if err == nil {
		err = run(o)
	}
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "kreld-profiler: %v\n", err)
		os.Exit(exitCode(err))
	}
}
