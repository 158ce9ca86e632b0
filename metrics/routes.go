package metrics

import "strings"

// APIRoutes are the route templates of the provider API (PROVIDER_API.md §4),
// the values of the endpoint label of proxyd_api_requests_total and
// proxyd_api_request_seconds. The 20 endpoints have 18 templates: GET and
// POST /api/product/{pid}, and GET and PUT /api/service/{id}, share theirs.
func APIRoutes() []string {
	return []string{
		"/api/clients",
		"/api/stats/{id}",
		"/api/rate/{id}",
		"/api/product/{pid}",
		"/api/products",
		"/api/products/orderby/{field}",
		"/api/networkstatus/errors/{id}",
		"/api/networkstatus/inactive/{id}",
		"/api/billing/credit",
		"/api/billing/invoices",
		"/api/billing/invoice/{id}",
		"/api/service/{id}",
		"/api/services",
		"/api/iplist/{typel}/{formatl}/{id}",
		"/api/sticky/list/{id}",
		"/api/sticky/rotate/{id}/{server}/{session}",
		"/api/sticky/changettl/{id}/{ttl}",
		"/api/sticky/resetall/{id}",
	}
}

// OtherRoute is the endpoint label value for a route that is not one of
// APIRoutes: a filled-in path must never become a label value.
const OtherRoute = "other"

// RotationResults are the label values of proxyd_sticky_rotations_total.
func RotationResults() []string { return []string{"ok", "error", "rate_limited"} }

// normalizeRoute maps route to its label value: an optional method prefix
// ("GET /api/...") is dropped, and anything that is not a known template
// becomes OtherRoute.
func normalizeRoute(known map[string]bool, route string) string {
	if i := strings.IndexByte(route, ' '); i >= 0 {
		route = strings.TrimSpace(route[i+1:])
	}
	if known[route] {
		return route
	}
	return OtherRoute
}

// normalizeCode keeps a three-digit HTTP status and turns anything else into
// "error" (DESIGN.md §6: no answer came).
func normalizeCode(code string) string {
	if len(code) == 3 && code[0] >= '1' && code[0] <= '5' &&
		code[1] >= '0' && code[1] <= '9' && code[2] >= '0' && code[2] <= '9' {
		return code
	}
	return "error"
}
