package providersim

import (
	"fmt"
	"time"
)

// IDs of the default world. Tests of other packages rely on them.
const (
	ClientAlice = 7 // alice@example.com
	ClientBob   = 8 // bob@example.com

	ProductStaticUS = 11 // fpr, 10.00 USD, group 1 "Static", 3 IPs
	ProductStaticDE = 12 // fpr, 20.50 USD, group 1 "Static", 5 IPs
	ProductRotating = 13 // ppr, 15.00 USD, group 2 "Rotating"
	ProductHidden   = 14 // fpr, hidden, in hidden group 3

	ServiceStatic     = 101 // fpr Active, client 7, http-auth/http-ip/socks-ip lists of 3 entries
	ServiceRotating   = 102 // ppr Active, client 7, 2 sticky sessions on gw1.sim.example; lists name the gateway by IP
	ServiceSuspended  = 103 // fpr Suspended, client 8; numbers encoded as strings
	ServiceNoSessions = 104 // ppr Active, client 8, Free, no sticky sessions, no stats, nextduedate ""
	ServiceTerminated = 105 // fpr Terminated, client 7, empty lists, nextduedate "0000-00-00"

	// Services numbered OrphanServiceMin..OrphanServiceMax belong to a
	// client that no longer exists: endpoints 8, 9 and 15 answer them with
	// 400 {"error":"Unprocessable Entity. ClientID not found"}, every other
	// endpoint as for an unknown service. They are not listed anywhere.
	OrphanServiceMin = 900
	OrphanServiceMax = 999

	// InitialCredit is the account credit of the default world in USD.
	InitialCredit = 100.00

	// StickyGateway is the server of the default sticky sessions: a host
	// name, as the provider's records carry one. LookupHost resolves it to
	// StickyGatewayAddr, the address the IP lists of ServiceRotating name.
	StickyGateway     = "gw1.sim.example"
	StickyGatewayAddr = "192.0.2.21"

	// Ports of the default world's rotating gateway, apart per protocol
	// like the provider's: each sticky session has its own HTTP port
	// (StickyHTTPPort1, StickyHTTPPort2: the port its record names), and
	// SOCKS5 is served on one port for every session.
	StickyHTTPPort1 = 10001
	StickyHTTPPort2 = 10002
	StickySOCKSPort = 2087
)

const (
	dateLayout     = "2006-01-02"
	dateTimeLayout = "2006-01-02 15:04:05"
)

type client struct {
	id    int
	email string
}

type group struct {
	id     int
	name   string
	hidden bool
}

type product struct {
	id            int
	name          string
	priceCents    int64
	priceAsString bool // in the product list, like a PHP backend would
	group         int
	typ           string // fpr | ppr
	hidden        bool
	createdAt     string
	ipCount       int // fpr only
	updateTime    string
	geo           []object
}

type service struct {
	id, client, product, orderID int
	productName                  string
	regdate, nextdue             string
	status, cycle                string
	username, password, bindedIP string
	typ                          string
	ipCount                      int
	priceCents                   int64
	numsAsStrings                bool

	lists             map[string][]Entry
	errored, inactive []string
	usageRate         float64
	usageLimit        float64
	noUsage           bool      // /api/rate answers []
	stats             []float64 // one per day, the last one is today
	sessions          []Session
	lastListUpdate    time.Time // zero: never updated
}

type invoice struct {
	id                     int
	description, status    string
	createdAt              string
	amountCents            int64
	refunded, paid, method string
	service                int
	numsAsStrings          bool
}

type world struct {
	clients     map[int]*client
	groups      map[int]*group
	products    map[int]*product
	services    map[int]*service
	invoices    map[int]*invoice
	creditCents int64
	nextService int
	nextOrder   int
	nextInvoice int
	nextExit    int                 // last octet of the next exit IP in 198.51.100.0/24
	gateways    map[string][]string // gateway host name (lower case) → addresses
}

// newWorld seeds the default world. Dates of services and invoices are
// relative to now; product dates are fixed.
func newWorld(now time.Time) *world {
	now = now.UTC()
	reg := now.AddDate(0, -1, -3)
	regDate := reg.Format(dateLayout)
	due := now.AddDate(0, 0, 27).Format(dateLayout)
	w := &world{
		clients: map[int]*client{
			ClientAlice: {id: ClientAlice, email: "alice@example.com"},
			ClientBob:   {id: ClientBob, email: "bob@example.com"},
		},
		groups: map[int]*group{
			1: {id: 1, name: "Static"},
			2: {id: 2, name: "Rotating"},
			3: {id: 3, name: "Private", hidden: true},
		},
		products: map[int]*product{
			ProductStaticUS: {
				id: ProductStaticUS, name: "Static US 10", priceCents: 1000, group: 1, typ: "fpr",
				createdAt: "2024-03-01", ipCount: 3, updateTime: "2026-11-01 04:00:00",
				geo: []object{
					{{"country", "US"}, {"city", "New York"}, {"ip_count", 2}},
					{{"country", "US"}, {"city", "Dallas"}, {"ip_count", 1}},
				},
			},
			ProductStaticDE: {
				id: ProductStaticDE, name: "Static DE 25", priceCents: 2050, priceAsString: true, group: 1, typ: "fpr",
				createdAt: "2024-05-12", ipCount: 5, updateTime: "2026-11-02 04:00:00",
				geo: []object{{{"country", "DE"}, {"city", "Frankfurt"}, {"ip_count", 5}}},
			},
			ProductRotating: {
				id: ProductRotating, name: "Rotating 1GB", priceCents: 1500, group: 2, typ: "ppr",
				createdAt: "2025-01-20",
			},
			ProductHidden: {
				id: ProductHidden, name: "Private Static", priceCents: 500, group: 3, typ: "fpr", hidden: true,
				createdAt: "2023-12-24", ipCount: 1, updateTime: "2026-10-30 04:00:00",
				geo: []object{{{"country", "NL"}, {"city", "Amsterdam"}, {"ip_count", 1}}},
			},
		},
		services:    make(map[int]*service),
		invoices:    make(map[int]*invoice),
		creditCents: 10000,
		nextService: 106,
		nextOrder:   5006,
		nextInvoice: 7004,
		nextExit:    3,
		gateways:    map[string][]string{StickyGateway: {StickyGatewayAddr}},
	}

	s101 := w.newService(ServiceStatic, ClientAlice, ProductStaticUS, 5001, regDate, due, "Active", "Monthly")
	s101.bindedIP = "203.0.113.50"
	s101.lists = fprLists([]string{"10.0.0.1", "10.0.0.2", "10.0.0.3"}, s101.username, s101.password)

	s102 := w.newService(ServiceRotating, ClientAlice, ProductRotating, 5002, regDate, due, "Active", "Monthly")
	// The rotating gateway as the provider runs it: lists of IPs, records
	// naming the gateway's host name with one port, the session's HTTP
	// port. So a session's HTTP upstream is found by its port in ppr-http
	// (through the addresses the name resolves to), its SOCKS5 one as the
	// only ppr-socks entry of the gateway.
	s102.lists = map[string][]Entry{
		"ppr-http": {
			{Host: StickyGatewayAddr, Port: StickyHTTPPort1, Login: s102.username, Password: s102.password},
			{Host: StickyGatewayAddr, Port: StickyHTTPPort2, Login: s102.username, Password: s102.password},
		},
		"ppr-socks": {
			{Host: StickyGatewayAddr, Port: StickySOCKSPort, Login: s102.username, Password: s102.password},
		},
	}
	s102.usageRate, s102.usageLimit = 300.5, 1024
	s102.stats = []float64{120, 80.25, 300.5}
	s102.sessions = []Session{
		{Server: StickyGateway, Session: "s1", Port: StickyHTTPPort1, HTTPPort: StickyHTTPPort1, SOCKSPort: StickySOCKSPort,
			ExitIP: "198.51.100.1", TTL: 5},
		{Server: StickyGateway, Session: "s2", Port: StickyHTTPPort2, HTTPPort: StickyHTTPPort2, SOCKSPort: StickySOCKSPort,
			ExitIP: "198.51.100.2", TTL: 5},
	}

	s103 := w.newService(ServiceSuspended, ClientBob, ProductStaticDE, 5003, regDate, due, "Suspended", "Quarterly")
	s103.numsAsStrings = true
	s103.bindedIP = ""
	s103.lists = fprLists([]string{"10.0.1.1", "10.0.1.2", "10.0.1.3", "10.0.1.4", "10.0.1.5"}, s103.username, s103.password)

	s104 := w.newService(ServiceNoSessions, ClientBob, ProductRotating, 5004, regDate, "", "Active", "Free")
	s104.lists = pprLists(s104.username, s104.password)
	s104.usageRate, s104.usageLimit = 0, 1024

	s105 := w.newService(ServiceTerminated, ClientAlice, ProductStaticUS, 5005, regDate, "0000-00-00", "Terminated", "Monthly")
	s105.lists = map[string][]Entry{}

	paid := reg.Format(dateLayout)
	w.invoices[7001] = &invoice{id: 7001, description: "Static US 10 - service #101", status: "Paid",
		createdAt: paid, amountCents: 1000, refunded: "0000-00-00", paid: paid, method: "credit", service: ServiceStatic}
	w.invoices[7002] = &invoice{id: 7002, description: "Rotating 1GB - service #102", status: "Paid",
		createdAt: paid, amountCents: 1500, refunded: "", paid: paid, method: "credit", service: ServiceRotating,
		numsAsStrings: true}
	w.invoices[7003] = &invoice{id: 7003, description: "Static DE 25 - service #103", status: "Unpaid",
		createdAt: now.AddDate(0, 0, -2).Format(dateLayout), amountCents: 2050, refunded: "0000-00-00",
		paid: "0000-00-00", method: "banktransfer", service: ServiceSuspended}
	return w
}

// newService adds a service of a product with credentials derived from its
// ID and no lists.
func (w *world) newService(id, clientID, productID, orderID int, reg, due, status, cycle string) *service {
	p := w.products[productID]
	sv := &service{
		id: id, client: clientID, product: productID, orderID: orderID,
		productName: p.name, regdate: reg, nextdue: due, status: status, cycle: cycle,
		username: fmt.Sprintf("u%d", id), password: fmt.Sprintf("pw-%d-sim", id),
		typ: p.typ, ipCount: p.ipCount, priceCents: p.priceCents,
		lists: map[string][]Entry{},
	}
	if p.typ == "ppr" {
		sv.usageLimit = 1024
	}
	w.services[id] = sv
	return sv
}

// fprLists builds the http-auth (port 8080, with credentials), http-ip
// (8080) and socks-ip (1080) lists of a static service.
func fprLists(hosts []string, login, password string) map[string][]Entry {
	lists := map[string][]Entry{}
	for _, h := range hosts {
		lists["http-auth"] = append(lists["http-auth"], Entry{Host: h, Port: 8080, Login: login, Password: password})
		lists["http-ip"] = append(lists["http-ip"], Entry{Host: h, Port: 8080})
		lists["socks-ip"] = append(lists["socks-ip"], Entry{Host: h, Port: 1080})
	}
	return lists
}

// pprLists builds the gateway lists of a rotating service without sticky
// sessions: two gateways by IP, HTTP on 8000 and SOCKS5 on 9000.
func pprLists(login, password string) map[string][]Entry {
	return map[string][]Entry{
		"ppr-http": {
			{Host: "192.0.2.21", Port: 8000, Login: login, Password: password},
			{Host: "192.0.2.22", Port: 8000, Login: login, Password: password},
		},
		"ppr-socks": {
			{Host: "192.0.2.21", Port: 9000, Login: login, Password: password},
			{Host: "192.0.2.22", Port: 9000, Login: login, Password: password},
		},
	}
}

// nextExitIP hands out exit IPs counting up in 198.51.100.0/24 (1..254,
// then again from 1).
func (w *world) nextExitIP() string {
	ip := fmt.Sprintf("198.51.100.%d", w.nextExit)
	w.nextExit++
	if w.nextExit > 254 {
		w.nextExit = 1
	}
	return ip
}

func isOrphan(id int) bool { return id >= OrphanServiceMin && id <= OrphanServiceMax }
