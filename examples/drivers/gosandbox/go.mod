module gosandbox

go 1.19
