package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/proxyd/proxyd/agent"
)

const apiUsage = `Usage: proxyd api [-config FILE | -base-url URL] [-json] COMMAND ...

Commands (flags after the positional arguments):
  clients
  products [-orderby FIELD]          FIELD: productId productName price groupId groupName created_at
  product PID
  order PID -client ID [-setip IP]
  services
  service ID
  service-update ID [-setip IP] [-update-list] [-password PW]   (-password - reads it from stdin)
  credit
  invoices
  invoice ID
  iplist ID -type TYPE -format FORMAT TYPE: http-ip socks-ip http-auth ppr-http ppr-socks; FORMAT: csv txt json
  netstatus ID
  stats ID
  rate ID
  sticky list ID
  sticky rotate ID SERVER SESSION
  sticky ttl ID MINUTES              MINUTES: 1 2 3 5 10 15
  sticky reset ID

Without -config the token comes from PROXYD_API_TOKEN.
`

// cmdAPI is `proxyd api`: every provider endpoint from the shell. Provider
// errors are one line on stderr and exit 1; usage errors exit 2.
func cmdAPI(ctx context.Context, args []string, io stdio) int {
	fs := flag.NewFlagSet("api", flag.ContinueOnError)
	fs.SetOutput(io.err)
	fs.Usage = func() { fmt.Fprint(io.err, apiUsage) }
	cfgPath := fs.String("config", "", "config file with an [api] section")
	baseURL := fs.String("base-url", "", "provider API base URL (default: the config's, or "+defaultConfig().API.BaseURL+")")
	asJSON := fs.Bool("json", false, "print the API's JSON instead of a table")
	timeout := fs.Duration("timeout", 0, "request timeout (default: the config's, or 15s)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() == 0 {
		fmt.Fprint(io.err, apiUsage)
		return 2
	}
	api := defaultConfig().API
	if *cfgPath != "" {
		cfg, err := loadConfig(*cfgPath)
		if err != nil {
			fmt.Fprintf(io.err, "proxyd api: %s:\n%v\n", *cfgPath, err)
			return 1
		}
		api = cfg.API
	}
	if *baseURL != "" {
		api.BaseURL = *baseURL
	}
	if *timeout > 0 {
		api.Timeout = *timeout
	}
	var err error
	if *cfgPath != "" {
		api, _, err = api.ResolveCredential(io.getenv)
	} else if api.Token = strings.TrimSpace(io.getenv(agent.TokenEnv)); api.Token == "" {
		// A quick call without a file: only the environment counts.
		err = errors.New("set PROXYD_API_TOKEN or use -config")
	}
	if err != nil {
		fmt.Fprintf(io.err, "proxyd api: %v\n", err)
		return 1
	}
	api.Version = version
	client, err := agent.New(api)
	if err != nil {
		fmt.Fprintf(io.err, "proxyd api: %v\n", err)
		return 1
	}
	c := &apiCommand{ctx: ctx, client: client, json: *asJSON, io: io}
	if err := c.run(fs.Args()); err != nil {
		fmt.Fprintf(io.err, "proxyd api: %s\n", oneLine(err))
		if errors.As(err, new(usageError)) {
			return 2
		}
		return 1
	}
	return 0
}

type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error { return usageError{fmt.Sprintf(format, args...)} }

type apiCommand struct {
	ctx    context.Context
	client *agent.Client
	json   bool
	io     stdio
}

// positional splits args into n positional arguments and parses the flags
// that follow them.
func positional(args []string, names []string, fs *flag.FlagSet) ([]string, error) {
	if len(args) < len(names) {
		return nil, usagef("missing %s", strings.Join(names[len(args):], " "))
	}
	for i := range names {
		if strings.HasPrefix(args[i], "-") {
			return nil, usagef("missing %s (flags come after it)", names[i])
		}
	}
	if fs == nil {
		fs = flag.NewFlagSet("", flag.ContinueOnError)
	}
	fs.SetOutput(io.Discard)
	if err := fs.Parse(args[len(names):]); err != nil {
		return nil, usagef("%v", err)
	}
	if fs.NArg() > 0 {
		return nil, usagef("unexpected argument %q", fs.Arg(0))
	}
	return args[:len(names)], nil
}

func atoiArg(name, s string) (int, error) {
	n, err := strconv.Atoi(s)
	if err != nil || n <= 0 {
		return 0, usagef("%s must be a positive number, got %q", name, s)
	}
	return n, nil
}

// idPositional is positional for commands whose first argument (named
// names[0]) is a positive number; it returns the arguments and that number.
func idPositional(args []string, names []string, fs *flag.FlagSet) ([]string, int, error) {
	p, err := positional(args, names, fs)
	if err != nil {
		return nil, 0, err
	}
	id, err := atoiArg(names[0], p[0])
	if err != nil {
		return nil, 0, err
	}
	return p, id, nil
}

// run runs one command; a usageError means exit 2, any other error exit 1.
func (c *apiCommand) run(args []string) error {
	cmd, rest := args[0], args[1:]
	if cmd == "sticky" {
		if len(rest) == 0 {
			return usagef("sticky needs list, rotate, ttl or reset")
		}
		cmd, rest = "sticky "+rest[0], rest[1:]
	}
	switch cmd {
	case "clients":
		if _, err := positional(rest, nil, nil); err != nil {
			return err
		}
		return c.show(agent.RouteClients, nil, func() (table, error) {
			v, err := c.client.Clients(c.ctx)
			t := table{head: []string{"ID", "EMAIL"}}
			for _, x := range v {
				t.add(x.ID, x.Email)
			}
			return t, err
		})
	case "products":
		fs := flag.NewFlagSet("products", flag.ContinueOnError)
		orderBy := fs.String("orderby", "", "")
		if _, err := positional(rest, nil, fs); err != nil {
			return err
		}
		route, rargs := agent.RouteProducts, []string(nil)
		if *orderBy != "" {
			route, rargs = agent.RouteProductsOrderBy, []string{*orderBy}
		}
		return c.show(route, rargs, func() (table, error) {
			var v []agent.ProductItem
			var err error
			if *orderBy != "" {
				v, err = c.client.ProductsOrderBy(c.ctx, *orderBy)
			} else {
				v, err = c.client.Products(c.ctx)
			}
			t := table{head: []string{"ID", "NAME", "PRICE", "GROUP", "CREATED"}}
			for _, x := range v {
				t.add(x.ProductID, x.ProductName, money(x.Price), fmt.Sprintf("%d %s", x.GroupID, x.GroupName), x.CreatedAt)
			}
			return t, err
		})
	case "product":
		p, pid, err := idPositional(rest, []string{"PID"}, nil)
		if err != nil {
			return err
		}
		return c.show(agent.RouteProduct, p, func() (table, error) {
			x, err := c.client.Product(c.ctx, pid)
			t := table{head: []string{"FIELD", "VALUE"}}
			if x != nil {
				t.add("product", strings.TrimSpace(fmt.Sprintf("%d %s", x.ProductID, x.ProductName)))
				t.add("type", x.ProductType)
				t.add("price", money(x.Price))
				t.add("group", fmt.Sprintf("%d %s", x.GroupID, x.GroupName))
				t.add("created", x.CreatedAt)
				t.add("hidden", fmt.Sprintf("product %t, group %t", x.ProductHidden, x.GroupHidden))
				if x.ProductType == "fpr" {
					t.add("ip_count", x.IPCount)
					if !x.UpdateTime.IsZero() {
						t.add("updated", x.UpdateTime.Format("2006-01-02 15:04:05"))
					}
					if len(x.Geo) > 0 {
						t.add("geo", string(x.Geo))
					}
				}
			}
			return t, err
		})
	case "order":
		fs := flag.NewFlagSet("order", flag.ContinueOnError)
		client := fs.Int("client", 0, "")
		setip := fs.String("setip", "", "")
		p, pid, err := idPositional(rest, []string{"PID"}, fs)
		if err != nil {
			return err
		}
		if *client <= 0 {
			return usagef("order needs -client ID")
		}
		req := agent.OrderRequest{ClientID: *client, SetIP: *setip}
		if c.json {
			return c.raw(http.MethodPost, agent.RouteProduct, p, req)
		}
		res, err := c.client.Order(c.ctx, pid, req)
		if err != nil {
			return err
		}
		t := table{head: []string{"SERVICE", "ORDER", "INVOICE", "AMOUNT", "IP"}}
		t.add(res.ServiceID, res.OrderID, res.InvoiceID, money(res.Amount), res.IP)
		return t.write(c.io.out)
	case "services":
		if _, err := positional(rest, nil, nil); err != nil {
			return err
		}
		return c.show(agent.RouteServices, nil, func() (table, error) {
			v, err := c.client.Services(c.ctx)
			t := table{head: []string{"ID", "ORDER", "PRODUCT", "STATUS", "NEXT DUE"}}
			for _, x := range v {
				t.add(x.ServiceID, x.OrderID, x.ProductName, x.Status, x.NextDueDate)
			}
			return t, err
		})
	case "service":
		p, id, err := idPositional(rest, []string{"ID"}, nil)
		if err != nil {
			return err
		}
		return c.show(agent.RouteService, p, func() (table, error) {
			x, err := c.client.Service(c.ctx, id)
			t := table{head: []string{"FIELD", "VALUE"}}
			if x != nil {
				t.add("service", x.ServiceID)
				t.add("order", x.OrderID)
				t.add("product", x.ProductName)
				t.add("type", x.ProductType)
				t.add("status", x.Status)
				t.add("billing", x.BillingCycle)
				t.add("price", money(x.Price))
				t.add("registered", x.RegDate)
				t.add("next due", x.NextDueDate)
				t.add("username", x.Username)
				t.add("password", x.Password)
				if x.ProductType != "ppr" {
					t.add("bound ip", x.BindedIP)
					t.add("ip_count", x.IPCount)
				}
			}
			return t, err
		})
	case "service-update":
		fs := flag.NewFlagSet("service-update", flag.ContinueOnError)
		setip := fs.String("setip", "", "")
		updateList := fs.Bool("update-list", false, "")
		password := fs.String("password", "", "")
		p, id, err := idPositional(rest, []string{"ID"}, fs)
		if err != nil {
			return err
		}
		pw := *password
		if pw == "-" {
			line, err := bufio.NewReader(c.io.in).ReadString('\n')
			if err != nil && line == "" {
				return usagef("reading the password from standard input: %v", err)
			}
			pw = strings.TrimRight(line, "\r\n")
		}
		upd := agent.ServiceUpdate{SetIP: *setip, UpdateList: *updateList, Password: pw}
		if upd == (agent.ServiceUpdate{}) {
			return usagef("service-update needs -setip, -update-list or -password")
		}
		if c.json {
			return c.raw(http.MethodPut, agent.RouteService, p, upd) // the body UpdateService sends
		}
		res, err := c.client.UpdateService(c.ctx, id, upd)
		t := table{head: []string{"ACTION", "RESULT"}}
		for _, k := range []string{"setip", "update_list", "password"} {
			if v, ok := res[k]; ok {
				t.add(k, v)
			}
		}
		if err != nil && len(t.rows) == 0 {
			return err
		}
		// One action refused: the table still says what became of each.
		if werr := t.write(c.io.out); werr != nil {
			return werr
		}
		return err
	case "credit":
		if _, err := positional(rest, nil, nil); err != nil {
			return err
		}
		return c.show(agent.RouteCredit, nil, func() (table, error) {
			v, err := c.client.Credit(c.ctx)
			t := table{head: []string{"CREDIT"}}
			t.add(money(v))
			return t, err
		})
	case "invoices":
		if _, err := positional(rest, nil, nil); err != nil {
			return err
		}
		return c.show(agent.RouteInvoices, nil, func() (table, error) {
			v, err := c.client.Invoices(c.ctx)
			return invoiceTable(v), err
		})
	case "invoice":
		p, id, err := idPositional(rest, []string{"ID"}, nil)
		if err != nil {
			return err
		}
		return c.show(agent.RouteInvoice, p, func() (table, error) {
			v, err := c.client.Invoice(c.ctx, id)
			return invoiceTable(v), err
		})
	case "iplist":
		fs := flag.NewFlagSet("iplist", flag.ContinueOnError)
		typ := fs.String("type", "", "")
		format := fs.String("format", "", "")
		p, id, err := idPositional(rest, []string{"ID"}, fs)
		if err != nil {
			return err
		}
		if *typ == "" || *format == "" {
			return usagef("iplist needs -type TYPE and -format FORMAT")
		}
		if c.json {
			// The list in the provider's own format, whatever it is.
			return c.raw(http.MethodGet, agent.RouteIPList, []string{*typ, *format, p[0]}, nil)
		}
		l, err := c.client.IPList(c.ctx, id, *typ, *format)
		if err != nil {
			return err
		}
		t := table{head: []string{"HOST", "PORT", "LOGIN", "PASSWORD"}}
		for _, e := range l.Entries {
			t.add(e.Host, e.Port, e.Login, e.Password)
		}
		if err := t.write(c.io.out); err != nil {
			return err
		}
		if l.Bad > 0 {
			fmt.Fprintf(c.io.err, "proxyd api: %d line(s) could not be read, first: %q\n", l.Bad, l.BadLines)
		}
		return nil
	case "netstatus":
		p, id, err := idPositional(rest, []string{"ID"}, nil)
		if err != nil {
			return err
		}
		if c.json {
			errored, err := c.client.Call(c.ctx, http.MethodGet, agent.RouteNetworkErrors, p, nil)
			if err != nil {
				return err
			}
			inactive, err := c.client.Call(c.ctx, http.MethodGet, agent.RouteNetworkInactive, p, nil)
			if err != nil {
				return err
			}
			fmt.Fprintf(c.io.out, "{\"errors\":%s,\"inactive\":%s}\n", strings.TrimSpace(string(errored)), strings.TrimSpace(string(inactive)))
			return nil
		}
		errored, err := c.client.NetworkErrors(c.ctx, id)
		if err != nil {
			return err
		}
		inactive, err := c.client.NetworkInactive(c.ctx, id)
		if err != nil {
			return err
		}
		t := table{head: []string{"IP", "STATUS"}}
		for _, ip := range errored {
			t.add(ip, "error")
		}
		for _, ip := range inactive {
			t.add(ip, "inactive")
		}
		return t.write(c.io.out)
	case "stats", "rate":
		p, id, err := idPositional(rest, []string{"ID"}, nil)
		if err != nil {
			return err
		}
		if cmd == "stats" {
			return c.show(agent.RouteStats, p, func() (table, error) {
				v, err := c.client.Stats(c.ctx, id)
				t := table{head: []string{"DATE", "RATE"}}
				for _, x := range v {
					t.add(x.Date, num(x.Rate))
				}
				return t, err
			})
		}
		return c.show(agent.RouteRate, p, func() (table, error) {
			v, err := c.client.Rate(c.ctx, id)
			t := table{head: []string{"RATE", "LIMIT", "USED"}}
			for _, x := range v {
				used := "-"
				if x.Limit > 0 {
					used = fmt.Sprintf("%.1f%%", 100*x.Rate/x.Limit)
				}
				t.add(num(x.Rate), num(x.Limit), used)
			}
			return t, err
		})
	case "sticky list":
		p, id, err := idPositional(rest, []string{"ID"}, nil)
		if err != nil {
			return err
		}
		return c.show(agent.RouteStickyList, p, func() (table, error) {
			l, err := c.client.StickyList(c.ctx, id)
			t := table{head: []string{"SERVER", "SESSION", "PORT", "EXIT IP", "TTL"}}
			if l != nil {
				for _, s := range l.Sessions {
					t.add(s.Server, s.Session, s.Port, s.ExitIP, s.TTL)
				}
			}
			return t, err
		})
	case "sticky rotate", "sticky ttl", "sticky reset":
		names := map[string][]string{"sticky rotate": {"ID", "SERVER", "SESSION"}, "sticky ttl": {"ID", "MINUTES"}, "sticky reset": {"ID"}}[cmd]
		p, id, err := idPositional(rest, names, nil)
		if err != nil {
			return err
		}
		var res *agent.StickyResult
		switch cmd {
		case "sticky rotate":
			res, err = c.client.StickyRotate(c.ctx, id, p[1], p[2])
		case "sticky ttl":
			ttl, perr := atoiArg("MINUTES", p[1])
			if perr != nil {
				return perr
			}
			res, err = c.client.StickyChangeTTL(c.ctx, id, ttl)
		default:
			res, err = c.client.StickyResetAll(c.ctx, id)
		}
		if err != nil {
			return err
		}
		if c.json {
			c.io.out.Write(ensureNewline(res.Raw))
			return nil
		}
		t := table{head: []string{"RESULT", "EXIT IP"}}
		body := strings.TrimSpace(string(res.Raw))
		if body == "" {
			body = "(empty answer)"
		}
		t.add(body, res.ExitIP)
		return t.write(c.io.out)
	}
	return usagef("unknown command %q (proxyd api -h lists them)", cmd)
}

func invoiceTable(v []agent.Invoice) table {
	t := table{head: []string{"ID", "STATUS", "AMOUNT", "CREATED", "PAID", "METHOD", "SERVICE", "DESCRIPTION"}}
	for _, x := range v {
		t.add(x.ID, x.Status, money(x.Amount), x.CreatedAt, x.DatePaid, x.PaymentMethod, x.ServiceID, x.Description)
	}
	return t
}

// show runs a read command: the raw JSON of route with -json, else the table.
func (c *apiCommand) show(route string, args []string, tab func() (table, error)) error {
	if c.json {
		return c.raw(http.MethodGet, route, args, nil)
	}
	t, err := tab()
	if err != nil {
		return err
	}
	return t.write(c.io.out)
}

func (c *apiCommand) raw(method, route string, args []string, body any) error {
	b, err := c.client.Call(c.ctx, method, route, args, body)
	if err != nil {
		return err
	}
	c.io.out.Write(ensureNewline(b))
	return nil
}

func ensureNewline(b []byte) []byte {
	if len(b) == 0 || b[len(b)-1] != '\n' {
		return append(b, '\n')
	}
	return b
}

// table is an aligned text table.
type table struct {
	head []string
	rows [][]string
}

func (t *table) add(cells ...any) {
	row := make([]string, len(cells))
	for i, c := range cells {
		switch v := c.(type) {
		case agent.Date:
			if v.IsZero() {
				row[i] = "-"
			} else {
				row[i] = v.Format("2006-01-02")
			}
		case string:
			if v == "" {
				v = "-"
			}
			row[i] = v
		default:
			row[i] = fmt.Sprint(v)
		}
	}
	t.rows = append(t.rows, row)
}

func (t table) write(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, strings.Join(t.head, "\t"))
	for _, r := range t.rows {
		fmt.Fprintln(tw, strings.Join(r, "\t"))
	}
	return tw.Flush()
}

func money(v float64) string { return strconv.FormatFloat(v, 'f', 2, 64) }

func num(v float64) string { return strconv.FormatFloat(v, 'f', -1, 64) }
