package providersim

import (
	"bytes"
	"cmp"
	"encoding/base64"
	"encoding/json"
	"io"
	"maps"
	"net/http"
	"net/netip"
	"slices"
	"strconv"
	"strings"
)

// Application error messages of the provider's API, byte-exact (some end in
// a space, as the provider's do).
const (
	msgUnprocessable      = "Unprocessable Entity"
	msgUnprocessableSpace = "Unprocessable Entity "
	msgProductNotFound    = "Unprocessable Entity or product ID not found"
	msgNotEnoughFunds     = "Unprocessed entity or not enough funds to order"
	msgIncorrectData      = "Unprocessable Entity. Incorrect posted data"
	msgClientNotFound     = "Unprocessable Entity. ClientID not found"
	msgInvalidIPv4        = "Unprocessable Entity. Invalid IPv4 format"
	msgIPAlreadyBound     = "Unprocessable Entity. IP already binded"
	msgTooManyAttempts    = "Too Many Attempts (updateList). Next update possible: "
	msgStickyNoService    = "Service not found"

	successIPUpdated       = "IP address updated successfully"
	successListUpdated     = "IP list updated successfully"
	successPasswordUpdated = "Password updated successfully"
	successTTLChanged      = "TTL changed"
)

// maxBody caps request bodies read by the simulator.
const maxBody = 1 << 20

func (s *Sim) routes() *http.ServeMux {
	m := http.NewServeMux()
	m.HandleFunc("GET /api/clients", s.clients)                              // 1
	m.HandleFunc("GET /api/stats/{id}", s.stats)                             // 2
	m.HandleFunc("GET /api/rate/{id}", s.rate)                               // 3
	m.HandleFunc("GET /api/product/{pid}", s.product)                        // 4
	m.HandleFunc("POST /api/product/{pid}", s.order)                         // 5
	m.HandleFunc("GET /api/products", s.products)                            // 6
	m.HandleFunc("GET /api/products/orderby/{field}", s.productsOrdered)     // 7
	m.HandleFunc("GET /api/networkstatus/errors/{id}", s.networkErrors)      // 8
	m.HandleFunc("GET /api/networkstatus/inactive/{id}", s.networkInactive)  // 9
	m.HandleFunc("GET /api/billing/credit", s.credit)                        // 10
	m.HandleFunc("GET /api/billing/invoices", s.invoices)                    // 11
	m.HandleFunc("GET /api/billing/invoice/{id}", s.invoice)                 // 12
	m.HandleFunc("GET /api/service/{id}", s.service)                         // 13
	m.HandleFunc("GET /api/services", s.services)                            // 14
	m.HandleFunc("PUT /api/service/{id}", s.updateService)                   // 15
	m.HandleFunc("GET /api/iplist/{typel}/{formatl}/{id}", s.ipList)         // 16
	m.HandleFunc("GET /api/sticky/list/{id}", s.stickyList)                  // 17
	m.HandleFunc("GET /api/sticky/rotate/{id}/{server}/{session}", s.rotate) // 18
	m.HandleFunc("GET /api/sticky/changettl/{id}/{ttl}", s.changeTTL)        // 19
	m.HandleFunc("GET /api/sticky/resetall/{id}", s.resetAll)                // 20
	return m
}

// pathID parses a numeric path parameter; -1 when it is not a positive
// decimal number.
func pathID(r *http.Request, name string) int {
	v := r.PathValue(name)
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 || strings.HasPrefix(v, "+") {
		return -1
	}
	return n
}

// 1. GET /api/clients
func (s *Sim) clients(w http.ResponseWriter, _ *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := []object{}
	for _, id := range slices.Sorted(maps.Keys(s.w.clients)) {
		c := s.w.clients[id]
		out = append(out, object{{"id", c.id}, {"email", c.email}})
	}
	writeJSON(w, http.StatusOK, out)
}

// pprService returns the service of path parameter "id" for the usage
// endpoints (2 and 3) when it is a ppr service of any status; otherwise it
// answers 422 "Unprocessable Entity " and returns nil. Called with s.mu held.
func (s *Sim) pprService(w http.ResponseWriter, r *http.Request) *service {
	sv := s.w.services[pathID(r, "id")]
	if sv == nil || sv.typ != "ppr" {
		writeError(w, http.StatusUnprocessableEntity, msgUnprocessableSpace)
		return nil
	}
	return sv
}

// 2. GET /api/stats/{id}: one item per day, the last one today (by
// Config.Now, UTC). Unknown and fpr services: 422 "Unprocessable Entity ".
func (s *Sim) stats(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	sv := s.pprService(w, r)
	if sv == nil {
		return
	}
	today := s.cfg.Now().UTC()
	out := []object{}
	for i, rate := range sv.stats {
		day := today.AddDate(0, 0, i-len(sv.stats)+1)
		out = append(out, object{{"date", day.Format(dateLayout)}, {"rate", rate}})
	}
	writeJSON(w, http.StatusOK, out)
}

// 3. GET /api/rate/{id}: [{"limit":..,"rate":..}]. Unknown and fpr
// services: 422 "Unprocessable Entity ".
func (s *Sim) rate(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	sv := s.pprService(w, r)
	if sv == nil {
		return
	}
	if sv.noUsage {
		writeJSON(w, http.StatusOK, []object{})
		return
	}
	writeJSON(w, http.StatusOK, []object{{{"limit", sv.usageLimit}, {"rate", sv.usageRate}}})
}

// 4. GET /api/product/{pid}: the single product, hidden ones included.
func (s *Sim) product(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.w.products[pathID(r, "pid")]
	if p == nil {
		writeError(w, http.StatusUnprocessableEntity, msgProductNotFound)
		return
	}
	g := s.w.groups[p.group]
	o := object{
		{"productId", p.id},
		{"price", money(p.priceCents, false)},
		{"groupId", g.id},
		{"groupName", g.name},
		{"created_at", p.createdAt},
		{"product_hidden", p.hidden},
		{"group_hidden", g.hidden},
		{"product_type", p.typ},
	}
	if p.typ == "fpr" {
		geo := p.geo
		if geo == nil {
			geo = []object{}
		}
		o = append(o, field{"ip_count", p.ipCount}, field{"update_time", p.updateTime}, field{"geo", geo})
	}
	writeJSON(w, http.StatusOK, o)
}

// 5. POST /api/product/{pid}: orders a service for a client, paid from
// the credit. Checks in order: product, body, client, funds. Hidden
// products can be ordered. setip is ignored for ppr products; for fpr it
// must be an IPv4 address bound to no other service, else the body is
// refused as incorrect posted data (the only body error endpoint 5 has).
func (s *Sim) order(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.w.products[pathID(r, "pid")]
	if p == nil {
		writeError(w, http.StatusUnprocessableEntity, msgProductNotFound)
		return
	}
	fields, ok := readObject(r)
	clientID, okClient := intField(fields["clientid"])
	setip, okSetIP := stringField(fields["setip"])
	if p.typ != "fpr" {
		setip = ""
	}
	if !ok || !okClient || !okSetIP || (setip != "" && (!isIPv4(setip) || s.boundElsewhere(setip, 0))) {
		writeError(w, http.StatusUnprocessableEntity, msgIncorrectData)
		return
	}
	if s.w.clients[clientID] == nil {
		writeError(w, http.StatusUnprocessableEntity, msgClientNotFound)
		return
	}
	if s.w.creditCents < p.priceCents {
		writeError(w, http.StatusUnprocessableEntity, msgNotEnoughFunds)
		return
	}

	now := s.cfg.Now().UTC()
	today := now.Format(dateLayout)
	id := s.w.nextService
	s.w.nextService++
	orderID := s.w.nextOrder
	s.w.nextOrder++
	invoiceID := s.w.nextInvoice
	s.w.nextInvoice++

	sv := s.w.newService(id, clientID, p.id, orderID, today, now.AddDate(0, 1, 0).Format(dateLayout), "Active", "Monthly")
	sv.bindedIP = setip
	if p.typ == "fpr" {
		hosts := make([]string, 0, p.ipCount)
		for i := 1; i <= p.ipCount; i++ {
			hosts = append(hosts, "10."+strconv.Itoa(1+id/256)+"."+strconv.Itoa(id%256)+"."+strconv.Itoa(i))
		}
		sv.lists = fprLists(hosts, sv.username, sv.password)
	} else {
		sv.lists = pprLists(sv.username, sv.password)
	}
	s.w.creditCents -= p.priceCents
	s.w.invoices[invoiceID] = &invoice{
		id: invoiceID, description: p.name + " - service #" + strconv.Itoa(id), status: "Paid",
		createdAt: today, amountCents: p.priceCents, refunded: "0000-00-00", paid: today,
		method: "credit", service: id,
	}
	writeJSON(w, http.StatusOK, object{
		{"serviceId", id},
		{"orderId", orderID},
		{"invoiceId", invoiceID},
		{"amount", money(p.priceCents, false)},
		{"ip", setip},
	})
}

// 6. GET /api/products: visible products (neither the product nor its
// group hidden), by productId.
func (s *Sim) products(w http.ResponseWriter, _ *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	writeJSON(w, http.StatusOK, s.productList("productId"))
}

// 7. GET /api/products/orderby/{field}: as 6, ordered ascending by field
// (ties by productId). Any other field: 422 "Unprocessable Entity" (the
// specification lists no error for this endpoint).
func (s *Sim) productsOrdered(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch f := r.PathValue("field"); f {
	case "productId", "productName", "price", "groupId", "groupName", "created_at":
		writeJSON(w, http.StatusOK, s.productList(f))
	default:
		writeError(w, http.StatusUnprocessableEntity, msgUnprocessable)
	}
}

func (s *Sim) productList(orderBy string) []object {
	var ps []*product
	for _, p := range s.w.products {
		if !p.hidden && !s.w.groups[p.group].hidden {
			ps = append(ps, p)
		}
	}
	slices.SortFunc(ps, func(a, b *product) int {
		ga, gb := s.w.groups[a.group], s.w.groups[b.group]
		by := 0
		switch orderBy {
		case "productName":
			by = strings.Compare(a.name, b.name)
		case "price":
			by = cmp.Compare(a.priceCents, b.priceCents)
		case "groupId":
			by = cmp.Compare(ga.id, gb.id)
		case "groupName":
			by = strings.Compare(ga.name, gb.name)
		case "created_at":
			by = strings.Compare(a.createdAt, b.createdAt)
		}
		return cmp.Or(by, cmp.Compare(a.id, b.id)) // ties by productId
	})
	out := []object{}
	for _, p := range ps {
		g := s.w.groups[p.group]
		out = append(out, object{
			{"productId", p.id},
			{"productName", p.name},
			{"price", money(p.priceCents, p.priceAsString)},
			{"groupId", g.id},
			{"groupName", g.name},
			{"created_at", p.createdAt},
		})
	}
	return out
}

// 8. GET /api/networkstatus/errors/{id}
func (s *Sim) networkErrors(w http.ResponseWriter, r *http.Request) {
	s.networkStatus(w, r, func(sv *service) []string { return sv.errored })
}

// 9. GET /api/networkstatus/inactive/{id}
func (s *Sim) networkInactive(w http.ResponseWriter, r *http.Request) {
	s.networkStatus(w, r, func(sv *service) []string { return sv.inactive })
}

// networkStatus answers a status list of any service; orphan services get
// the 400 ClientID form, unknown ones 422 "Unprocessable Entity ".
func (s *Sim) networkStatus(w http.ResponseWriter, r *http.Request, list func(*service) []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	sv := s.clientService(w, r, msgUnprocessableSpace)
	if sv == nil {
		return
	}
	out := append([]string{}, list(sv)...)
	writeJSON(w, http.StatusOK, out)
}

// clientService returns the service of path parameter "id" for the
// endpoints that check its client (8, 9 and 15): an orphan service is
// answered 400 "ClientID not found", an unknown one 422 unknownMsg, and nil
// returned. Called with s.mu held.
func (s *Sim) clientService(w http.ResponseWriter, r *http.Request, unknownMsg string) *service {
	id := pathID(r, "id")
	if isOrphan(id) {
		writeError(w, http.StatusBadRequest, msgClientNotFound)
		return nil
	}
	sv := s.w.services[id]
	if sv == nil {
		writeError(w, http.StatusUnprocessableEntity, unknownMsg)
	}
	return sv
}

// 10. GET /api/billing/credit
func (s *Sim) credit(w http.ResponseWriter, _ *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	writeJSON(w, http.StatusOK, object{{"credit", money(s.w.creditCents, false)}})
}

// 11. GET /api/billing/invoices, by id.
func (s *Sim) invoices(w http.ResponseWriter, _ *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := []object{}
	for _, id := range slices.Sorted(maps.Keys(s.w.invoices)) {
		out = append(out, encodeInvoice(s.w.invoices[id]))
	}
	writeJSON(w, http.StatusOK, out)
}

// 12. GET /api/billing/invoice/{id}: a one-element array, or [] when the
// invoice does not exist (whatever the id looks like).
func (s *Sim) invoice(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := []object{}
	if inv := s.w.invoices[pathID(r, "id")]; inv != nil {
		out = append(out, encodeInvoice(inv))
	}
	writeJSON(w, http.StatusOK, out)
}

func encodeInvoice(inv *invoice) object {
	return object{
		{"id", integer(inv.id, inv.numsAsStrings)},
		{"description", inv.description},
		{"status", inv.status},
		{"created_at", inv.createdAt},
		{"amount", money(inv.amountCents, inv.numsAsStrings)},
		{"date_refunded", inv.refunded},
		{"date_paid", inv.paid},
		{"paymentmethod", inv.method},
		{"serviceid", integer(inv.service, inv.numsAsStrings)},
	}
}

// 13. GET /api/service/{id}. Unknown and orphan services: 422
// "Unprocessable Entity" (the specification lists no error here).
func (s *Sim) service(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	sv := s.w.services[pathID(r, "id")]
	if sv == nil {
		writeError(w, http.StatusUnprocessableEntity, msgUnprocessable)
		return
	}
	str := sv.numsAsStrings
	o := object{
		{"service_id", integer(sv.id, str)},
		{"orderid", integer(sv.orderID, str)},
		{"product_name", sv.productName},
		{"regdate", sv.regdate},
		{"nextduedate", sv.nextdue},
		{"status", sv.status},
		{"billingcycle", sv.cycle},
		{"username", sv.username},
		{"password", sv.password},
	}
	if sv.typ == "fpr" {
		o = append(o, field{"bindedip", sv.bindedIP})
	}
	o = append(o, field{"product_type", sv.typ})
	if sv.typ == "fpr" {
		o = append(o, field{"ip_count", integer(sv.ipCount, str)})
	}
	o = append(o, field{"price", money(sv.priceCents, str)})
	writeJSON(w, http.StatusOK, o)
}

// 14. GET /api/services, by service_id.
func (s *Sim) services(w http.ResponseWriter, _ *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := []object{}
	for _, id := range slices.Sorted(maps.Keys(s.w.services)) {
		sv := s.w.services[id]
		out = append(out, object{
			{"service_id", integer(sv.id, sv.numsAsStrings)},
			{"product_name", sv.productName},
			{"nextduedate", sv.nextdue},
			{"orderid", integer(sv.orderID, sv.numsAsStrings)},
			{"status", sv.status},
		})
	}
	writeJSON(w, http.StatusOK, out)
}

// 15. PUT /api/service/{id}: the body is optional; each of setip,
// update_list ("true", or JSON true) and password (base64) that is present
// and non-empty is an action. Everything is validated before anything is
// changed. Checks in order: orphan service (400), unknown service, body
// shape, setip (ppr services have none: 422 "Unprocessable Entity"),
// password, update_list rate limit (429, next time in UTC).
func (s *Sim) updateService(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	sv := s.clientService(w, r, msgUnprocessable)
	if sv == nil {
		return
	}
	fields, ok := readObject(r)
	if !ok {
		writeError(w, http.StatusUnprocessableEntity, msgIncorrectData)
		return
	}
	setip, ok1 := stringField(fields["setip"])
	passwordB64, ok2 := stringField(fields["password"])
	update, ok3 := boolField(fields["update_list"])
	if !ok1 || !ok2 || !ok3 {
		writeError(w, http.StatusUnprocessableEntity, msgIncorrectData)
		return
	}
	if setip != "" {
		switch {
		case sv.typ != "fpr":
			writeError(w, http.StatusUnprocessableEntity, msgUnprocessable)
			return
		case !isIPv4(setip):
			writeError(w, http.StatusUnprocessableEntity, msgInvalidIPv4)
			return
		case s.boundElsewhere(setip, sv.id):
			writeError(w, http.StatusUnprocessableEntity, msgIPAlreadyBound)
			return
		}
	}
	var password string
	if passwordB64 != "" {
		raw, err := base64.StdEncoding.Strict().DecodeString(passwordB64)
		if err != nil || len(raw) == 0 || !printable(raw) {
			writeError(w, http.StatusUnprocessableEntity, msgIncorrectData)
			return
		}
		password = string(raw)
	}
	now := s.cfg.Now()
	if update && !sv.lastListUpdate.IsZero() {
		if next := sv.lastListUpdate.Add(s.cfg.UpdateListInterval); now.Before(next) {
			writeError(w, http.StatusTooManyRequests, msgTooManyAttempts+next.UTC().Format(dateTimeLayout))
			return
		}
	}

	out := object{}
	if setip != "" {
		sv.bindedIP = setip
		out = append(out, field{"setip", object{{"success", successIPUpdated}}})
	}
	if update {
		sv.lastListUpdate = now
		out = append(out, field{"update_list", object{{"success", successListUpdated}}})
	}
	if passwordB64 != "" {
		// The plan's lines carry the plan's credentials: they change with it.
		for typ, entries := range sv.lists {
			for i, e := range entries {
				if e.Login == sv.username && e.Password == sv.password {
					sv.lists[typ][i].Password = password
				}
			}
		}
		sv.password = password
		out = append(out, field{"password", object{{"success", successPasswordUpdated}}})
	}
	writeJSON(w, http.StatusOK, out)
}

// boundElsewhere reports whether ip is bound to a service other than self.
func (s *Sim) boundElsewhere(ip string, self int) bool {
	for _, sv := range s.w.services {
		if sv.id != self && sv.bindedIP == ip {
			return true
		}
	}
	return false
}

// 16. GET /api/iplist/{typel}/{formatl}/{id}: the list in the simulator's
// layout, whatever the service status. Unknown type, format or service,
// or a type of the other product type: 422 "Unprocessable Entity".
func (s *Sim) ipList(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	creds, productType, ok := listType(r.PathValue("typel"))
	format := r.PathValue("formatl")
	sv := s.w.services[pathID(r, "id")]
	if !ok || (format != "txt" && format != "csv" && format != "json") || sv == nil || sv.typ != productType {
		writeError(w, http.StatusUnprocessableEntity, msgUnprocessable)
		return
	}
	entries := sv.lists[r.PathValue("typel")]
	if productType == "ppr" && s.layout.PPRHosts == PPRHostName {
		entries = s.byGatewayName(entries)
	}
	body, contentType := renderList(s.layout, format, creds, entries)
	w.Header().Set("Content-Type", contentType)
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(body)
}

// byGatewayName returns entries with each host that is an address of a
// gateway (SetGateway) replaced by the gateway's name; the first name in
// sorted order when several share the address. s.mu is held.
func (s *Sim) byGatewayName(entries []Entry) []Entry {
	names := map[string]string{}
	for _, name := range slices.Sorted(maps.Keys(s.w.gateways)) {
		for _, a := range s.w.gateways[name] {
			if _, ok := names[a]; !ok {
				names[a] = name
			}
		}
	}
	out := slices.Clone(entries)
	for i := range out {
		if name, ok := names[out[i].Host]; ok {
			out[i].Host = name
		}
	}
	return out
}

// activePPR reports whether sticky sessions of sv can be managed.
func activePPR(sv *service) bool { return sv.typ == "ppr" && sv.status == "Active" }

// managedSessions returns the request's service when its sticky sessions
// can be managed; otherwise it answers (422 with unknown for an unknown
// service, [] for fpr or inactive ones) and returns nil. s.mu is held.
func (s *Sim) managedSessions(w http.ResponseWriter, r *http.Request, unknown string) *service {
	sv := s.w.services[pathID(r, "id")]
	switch {
	case sv == nil:
		writeError(w, http.StatusUnprocessableEntity, unknown)
		return nil
	case !activePPR(sv):
		writeJSON(w, http.StatusOK, []object{})
		return nil
	}
	return sv
}

// 17. GET /api/sticky/list/{id}: sessions in Layout.StickyShape; [] for
// fpr or inactive services; 422 {"error":"Service not found"} for unknown
// ones (the "descriptive message supplied by the backend").
func (s *Sim) stickyList(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	sv := s.managedSessions(w, r, msgStickyNoService)
	if sv == nil {
		return
	}
	wrapped := s.layout.StickyShape == StickyWrapped
	out := []object{}
	for _, ss := range sv.sessions {
		if wrapped {
			o := object{{"host", ss.Server}, {"session_id", ss.Session}}
			o = append(o, recordPorts(s.layout.StickyPorts, ss, true)...)
			out = append(out, append(o, field{"exit_ip", ss.ExitIP}, field{"ttl", ss.TTL}))
		} else {
			o := object{{"server", ss.Server}, {"session", ss.Session}}
			o = append(o, recordPorts(s.layout.StickyPorts, ss, false)...)
			out = append(out, append(o, field{"ip", ss.ExitIP}, field{"ttl", ss.TTL}))
		}
	}
	if wrapped {
		writeJSON(w, http.StatusOK, object{{"sessions", out}})
		return
	}
	writeJSON(w, http.StatusOK, out)
}

// recordPorts writes the port fields of a sticky record as Layout.StickyPorts
// says, as strings when asStrings.
func recordPorts(mode string, ss Session, asStrings bool) object {
	num := func(n int) any {
		if asStrings {
			return strconv.Itoa(n)
		}
		return n
	}
	var perProtocol object
	for _, p := range []struct {
		key, protocol string
		port          int
	}{{"http_port", "http", ss.HTTPPort}, {"socks_port", "socks5", ss.SOCKSPort}} {
		if p.port == 0 {
			continue
		}
		if mode == StickyPortObject {
			perProtocol = append(perProtocol, field{p.protocol, num(p.port)})
		} else {
			perProtocol = append(perProtocol, field{p.key, num(p.port)})
		}
	}
	switch mode {
	case StickyPortSplit:
		return perProtocol
	case StickyPortObject:
		if perProtocol == nil {
			perProtocol = object{}
		}
		return object{{"ports", perProtocol}}
	case StickyPortNone:
		return nil
	}
	return object{{"port", num(ss.Port)}}
}

// 18. GET /api/sticky/rotate/{id}/{server}/{session}: gives the session the
// next exit IP and answers {"success":true,"server":..,"session":..,"ip":..}.
// Unknown, fpr or inactive service, or unknown session: 422 "Unprocessable
// Entity". A RotateHook may answer instead.
func (s *Sim) rotate(w http.ResponseWriter, r *http.Request) {
	id, server, session := pathID(r, "id"), r.PathValue("server"), r.PathValue("session")
	s.mu.Lock()
	hook := s.rotateHook
	s.mu.Unlock()
	if hook != nil {
		if status, body := hook(id, server, session); status != 0 {
			writeRaw(w, status, body)
			return
		}
	}

	s.mu.Lock()
	defer s.mu.Unlock()
	sv := s.w.services[id]
	if sv == nil || !activePPR(sv) {
		writeError(w, http.StatusUnprocessableEntity, msgUnprocessable)
		return
	}
	for i := range sv.sessions {
		ss := &sv.sessions[i]
		if ss.Server == server && ss.Session == session {
			ss.ExitIP = s.w.nextExitIP()
			writeJSON(w, http.StatusOK, object{{"success", true}, {"server", ss.Server},
				{"session", ss.Session}, {"ip", ss.ExitIP}})
			return
		}
	}
	writeError(w, http.StatusUnprocessableEntity, msgUnprocessable)
}

// validTTLs are the sticky session TTLs endpoint 19 accepts (the API allows
// only these, most likely minutes).
var validTTLs = []int{1, 2, 3, 5, 10, 15}

// 19. GET /api/sticky/changettl/{id}/{ttl}: sets the TTL of every session
// and answers {"success":"TTL changed"}. Unknown service or a TTL other
// than 1, 2, 3, 5, 10, 15: 422 "Unprocessable Entity " (TTL checked
// first); fpr or inactive service: 200 with an empty body.
func (s *Sim) changeTTL(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ttl, err := strconv.Atoi(r.PathValue("ttl"))
	sv := s.w.services[pathID(r, "id")]
	if err != nil || !slices.Contains(validTTLs, ttl) || sv == nil {
		writeError(w, http.StatusUnprocessableEntity, msgUnprocessableSpace)
		return
	}
	if !activePPR(sv) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusOK)
		return
	}
	for i := range sv.sessions {
		sv.sessions[i].TTL = ttl
	}
	writeJSON(w, http.StatusOK, object{{"success", successTTLChanged}})
}

// 20. GET /api/sticky/resetall/{id}: gives every session a new exit IP and
// answers {"success":true,"reset":<count>}. Unknown service: 422
// "Unprocessable Entity"; fpr or inactive service: [].
func (s *Sim) resetAll(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	sv := s.managedSessions(w, r, msgUnprocessable)
	if sv == nil {
		return
	}
	for i := range sv.sessions {
		sv.sessions[i].ExitIP = s.w.nextExitIP()
	}
	writeJSON(w, http.StatusOK, object{{"success", true}, {"reset", len(sv.sessions)}})
}

// readObject reads an optional JSON object body. An empty body or null is
// an empty object; anything else that is not an object is refused.
func readObject(r *http.Request) (map[string]json.RawMessage, bool) {
	body, err := io.ReadAll(io.LimitReader(r.Body, maxBody+1))
	if err != nil || len(body) > maxBody {
		return nil, false
	}
	body = bytes.TrimSpace(body)
	if len(body) == 0 {
		return map[string]json.RawMessage{}, true
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(body, &m); err != nil {
		return nil, false
	}
	if m == nil {
		m = map[string]json.RawMessage{}
	}
	return m, true
}

// intField accepts a JSON integer or a string of decimal digits; a missing
// field is refused.
func intField(raw json.RawMessage) (int, bool) {
	if raw == nil {
		return 0, false
	}
	var n json.Number
	if err := json.Unmarshal(raw, &n); err == nil {
		v, err := strconv.Atoi(n.String())
		return v, err == nil
	}
	var str string
	if err := json.Unmarshal(raw, &str); err == nil {
		v, err := strconv.Atoi(str)
		return v, err == nil
	}
	return 0, false
}

// stringField accepts a JSON string, null or a missing field ("").
func stringField(raw json.RawMessage) (string, bool) {
	if raw == nil {
		return "", true
	}
	var str *string
	if err := json.Unmarshal(raw, &str); err != nil {
		return "", false
	}
	if str == nil {
		return "", true
	}
	return *str, true
}

// boolField reads update_list: "true" or true request the action; "false",
// false, "", null or a missing field do not; anything else is refused.
func boolField(raw json.RawMessage) (bool, bool) {
	if raw == nil {
		return false, true
	}
	var b bool
	if err := json.Unmarshal(raw, &b); err == nil {
		return b, true
	}
	str, ok := stringField(raw)
	switch {
	case !ok:
		return false, false
	case str == "true":
		return true, true
	case str == "false" || str == "":
		return false, true
	}
	return false, false
}

func isIPv4(s string) bool {
	a, err := netip.ParseAddr(s)
	return err == nil && a.Is4()
}
